"""vLLM's OffloadingConnector's part of a state digest (``connector: offloading``, 0.32-0.34).

A CPU-offload replay carries past a boundary what vLLM's
``OffloadingConnectorScheduler`` keeps (each request's offload state: its
keys, how far it stored, its hit chunks, its transfer jobs; the jobs in
flight and the fences of a reset), its ``CPUOffloadingManager`` (the CPU
tier: which keys it holds, each chunk's reference count, what is evictable,
and the LRU policy's recency order), and the worker-side connector's job
bookkeeping. :func:`offload_section` writes them; :data:`EXCLUDED` names what
it leaves out, each with its reason, and is merged into the digest's list.

Numbers counted from the engine's start are written so that two engines at
the same state write the same:

* **GPU block ids** (a request's blocks per group, fenced and pending-flush
  blocks) as the digest's block labels, as everywhere else;
* **job ids** as their distance from the scheduler's next one (only ever
  matched for equality, or against the stale-job threshold a reset sets to the
  next one: which jobs in flight lie below it is written);
* **LRU ranks** (each key's and each live request's) by their order among
  all of them (vLLM only compares them; a new rank is above every one);
* **cache generations** (bumped by each reset) as whether they are the
  current one (vLLM only asks that).

Left out: the **CPU chunk ids** (which chunk of the tier holds a key addresses
the copy alone; the transfer seam moves no bytes, and no decision reads an
id: the number of free chunks is written), the LRU heap (a lazy heap over the
ranks and the evictable set, both written: stale entries are skipped, so it
evicts by (rank, key) over the evictable keys), wall-clock times and metrics,
and configuration. Only the LRU policy is read: ARC's state is not, and its
boundaries are never trusted. vLLM 0.32 keeps one number per key for its rank
and has no request ranks, reset fences, synchronous loads or step lock; the
fields it lacks are read as absent, and any other difference fails. vLLM
0.34's worker-side connector also keeps the KV caches it registered and its
failed jobs: its line is written by :mod:`.release_0_34` (``worker``).
"""

from __future__ import annotations

from typing import Any, Callable

from replayer.replay.engines.digest.walk import DigestError

_CONFIG = "configuration: the same trace builds the same on both sides"
_OWN = "walked in the offload section (replayer/replay/engines/digest/offload.py)"
_METRICS = "metrics, handed to the stats logger and never read back by a decision"
_STEP = "set and cleared within a step: required empty at a pause"
_CODE = "the replayer's recording wrapper around vLLM's method (code)"

EXCLUDED: dict[str, dict[str, str]] = {
    "OffloadingConnector": {"_canonical_layout": _CONFIG, "_bounding_group_ids": _CONFIG,
                            "connector_scheduler": _OWN, "connector_worker": _OWN},
    "OffloadingConnectorScheduler": {
        **dict.fromkeys(("config", "_full_attention_groups", "_sliding_window_groups",
                         "_lookup_groups", "_mamba_align_size", "_partial_tail_block_size",
                         "_eagle_proof_margins", "_max_eagle_proof_margin",
                         "_cow_source_groups"), _CONFIG),
        "_connector_stats": _METRICS, "_info_sent": _METRICS,
        "_reset_fence_since": "a wall-clock time, for a warning only",
        **dict.fromkeys(("manager", "_req_status", "_jobs", "_reset_fence",
                         "_block_id_to_pending_jobs", "_job_counter",
                         "_stale_job_threshold"), _OWN),
        **dict.fromkeys(("_current_batch_load_jobs", "_current_batch_sync_loads",
                         "_current_batch_sync_load_bytes", "_current_batch_jobs_to_flush",
                         "_current_batch_allocated_block_ids", "_step_region"), _STEP),
        "get_num_new_matched_tokens": "the replayer's lookup recorder around vLLM's "
                                      "method (code)"},
    "CPUOffloadingManager": {
        **dict.fromkeys(("medium", "_num_chunks", "_config_info", "store_threshold",
                         "max_tracker_size"), _CONFIG),
        "_num_allocated_chunks": "CPU chunk ids handed out so far: the free chunks are "
                                 "written instead", "_free_list": "CPU chunk ids: the free "
                                 "chunks are written instead",
        "_policy": _OWN, "_cache_generation": _OWN + " (as whether a request's is current)",
        **dict.fromkeys(("lookup", "prepare_load", "prepare_store", "complete_store"), _CODE)},
    "RequestOffloadState": {
        "config": _CONFIG, "transfer_jobs": _OWN + " (by distance from the next job)",
        "group_states": _OWN + " (block ids as labels)",
        "deferred_lookup_start_time": "a wall-clock time for a metric: written as whether "
                                      "it is set"},
    "RequestGroupState": {"block_ids": _OWN + " (as block labels)"},
    "ReqContext": {"_state": _OWN + " (ranks and generations made relative)"},
    "OffloadingConnectorWorker": {
        "spec": _CONFIG + " (the worker's offloading spec; the manager is the "
                          "scheduler's, walked there)",
        "vllm_config": _CONFIG, "kv_cache_config": _CONFIG, "_is_store_writer": _CONFIG,
        "worker": _OWN + " (the transfer seam: no job in flight at a pause)",
        "_load_jobs": _OWN, "_unsubmitted_store_jobs": _OWN,
        "_connector_worker_meta": _OWN + " (completed jobs by distance; its transfer "
                                         "stats are metrics)"},
}


def _empty_within_step(cs: Any) -> None:
    """A step's own fields are empty at a pause (vLLM 0.32 has no synchronous
    loads and no step lock: its scheduler lacks those three)."""
    for name in ("_current_batch_load_jobs", "_current_batch_sync_loads",
                 "_current_batch_jobs_to_flush", "_current_batch_allocated_block_ids"):
        if getattr(cs, name, None if name == "_current_batch_sync_loads" else 1):
            raise DigestError(f"offload.scheduler.{name}: not empty at a pause")
    if getattr(cs, "_current_batch_sync_load_bytes", 0) or getattr(cs, "_step_region", None):
        raise DigestError("offload.scheduler: a step's loads or lock still open at a pause")


def _rank(r: Any) -> int:
    """A key's rank: 0.33's (request rank, -position), 0.32's one number."""
    return r[0] if isinstance(r, tuple) else r


class _Ranks:
    """LRU ranks by their order among all the policy and live requests hold."""

    def __init__(self, policy: Any, contexts: list[Any]) -> None:
        from vllm.v1.kv_offload.cpu.policies import lru

        # 0.33's requests share a rank across batches; 0.32's LRU has none.
        self.kind = getattr(lru, "_RequestRank", None)
        seen = {_rank(r) for r in policy._ranks.values()} | {policy._next_rank}
        for ctx in contexts:
            st = None if self.kind is None else ctx.get_state(self.kind)
            if st is not None:
                seen.add(st.rank)
        self.order = {r: i for i, r in enumerate(sorted(seen))}


def _policy(d: Any, policy: Any, ranks: _Ranks) -> list[str]:
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    if type(policy) is not LRUCachePolicy:
        raise DigestError(f"offload: a {type(policy).__name__} cache policy, whose state "
                          "the digest does not read (LRU's it does)")
    order = ranks.order
    # By key: no decision walks the map in order (eviction follows the ranks).
    chunks = " ".join(f"{k.hex()}:{c.ref_cnt}" for k, c in sorted(policy.chunks.items()))
    by_rank = sorted(policy._ranks.items(), key=lambda kv: (kv[1], kv[0]))
    recency = " ".join(f"{k.hex()}@{order[_rank(r)]},{r[1] if isinstance(r, tuple) else ''}"
                       for k, r in by_rank)
    evictable = " ".join(sorted(k.hex() for k in policy._evictable))
    return [f"lru chunks {chunks}", f"lru recency {recency} next={order[policy._next_rank]}",
            f"lru evictable {evictable}"]


def _context(d: Any, ctx: Any, path: str, manager: Any, policy: Any, ranks: _Ranks) -> str:
    """A request's ReqContext: its fields, and the states the manager and policy
    keep in it with ranks by order and generations as current or not."""
    parts = [d.obj(ctx, path)]
    for kind, st in ctx._state.items():
        if ranks.kind is not None and isinstance(st, ranks.kind):
            cur = st.owner is policy and st.cache_generation == policy._cache_generation
            parts.append(f"rank {ranks.order[st.rank]} current={cur}")
        elif type(st).__name__ == "_RequestCacheAccess":
            cur = st.owner is manager and st.cache_generation == manager._cache_generation
            body = d.canon.obj(st, f"{path}.access", frozenset(("owner", "cache_generation")))
            parts.append(f"access current={cur} {body}")
        else:
            raise DigestError(f"{path}._state: a {kind.__name__}, which the digest does not "
                              "read")
    return " ".join(parts)


def _requests(d: Any, cs: Any, blocks: Any, nxt: int, manager: Any, policy: Any,
              ranks: _Ranks) -> list[str]:
    out = []
    for rid, st in cs._req_status.items():
        path = f"offload.req[{rid!r}]"
        groups = "|".join(d.obj(g, f"{path}.group") + " blocks "
                          + " ".join(d.block(blocks[i]) for i in g.block_ids)
                          for g in st.group_states)
        out.append(f"{rid!r} {d.canon.obj(st, path, frozenset(('req_context',)))} "
                   f"deferred={st.deferred_lookup_start_time is not None} "
                   f"jobs={sorted(nxt - j for j in st.transfer_jobs)} {groups} "
                   + _context(d, st.req_context, f"{path}.ctx", manager, policy, ranks))
    return out


def _jobs(d: Any, cs: Any, blocks: Any, nxt: int) -> list[str]:
    stale = cs._stale_job_threshold
    fence = getattr(cs, "_reset_fence", {})          # 0.33's: none on 0.32
    def labels(ids: Any) -> str:
        return "-" if ids is None else " ".join(d.block(blocks[i]) for i in ids)

    jobs = [f"{nxt - j} {d.canon.obj(s, f'offload.job[{nxt - j}]', _JOB_IDS)} "
            f"deferred_fence={labels(s.deferred_fence_block_ids)} "
            f"fenced={labels(s.fenced_block_ids)}" for j, s in cs._jobs.items()]
    pending = [f"{d.block(blocks[b])}:{sorted(nxt - j for j in js)}"
               for b, js in cs._block_id_to_pending_jobs.items()]
    return ["jobs " + "; ".join(jobs), "pending " + " ".join(pending),
            # A completed job below the threshold (set to the next job at a reset)
            # is stale: only which jobs in flight lie below it counts.
            f"fence {sorted((nxt - j, n) for j, n in fence.items())} stale "
            f"{sorted(nxt - j for j in set(cs._jobs) | set(fence) if j < stale)}"]


_JOB_IDS = frozenset(("deferred_fence_block_ids", "fenced_block_ids"))


# A release's writer of the worker-side connector's line (its fields but the jobs
# below): (digest, connector worker, path, next job id) -> text. None: walked.
WorkerWriter = Callable[[Any, Any, str, int], str]


def _worker(d: Any, conn: Any, nxt: int, writer: WorkerWriter | None = None) -> list[str]:
    w = conn.connector_worker
    if w.worker is not None and getattr(w.worker, "_done", None):
        raise DigestError("offload.worker: transfers reported at no get_finished yet")
    meta = w._connector_worker_meta
    path = "offload.worker.connector"
    body = d.obj(w, path) if writer is None else writer(d, w, path, nxt)
    return [f"worker {d.obj(conn, 'offload.worker')} {body}",
            f"worker loads {sorted((nxt - j, r) for j, r in w._load_jobs.items())} "
            f"unsubmitted {[nxt - j for j, _, _ in w._unsubmitted_store_jobs]} "
            f"completed {sorted((nxt - j, n) for j, n in meta.completed_jobs.items())}"]


def offload_section(d: Any, engine: Any, worker: WorkerWriter | None = None) -> list[str]:
    """The offload section's lines (the session is an OffloadSession); ``worker``:
    a release's writer of the worker-side connector (0.34's, :mod:`.release_0_34`)."""
    session = engine.session
    sched = engine.scheduler
    cs = sched.connector.connector_scheduler
    blocks = sched.kv_cache_manager.block_pool.blocks
    manager = cs.manager
    policy = manager._policy
    _empty_within_step(cs)
    nxt = cs._job_counter
    contexts = [st.req_context for st in cs._req_status.values()]
    ranks = _Ranks(policy, contexts)
    free = len(manager._free_list) + manager._num_chunks - manager._num_allocated_chunks
    out = [f"scheduler {d.obj(sched.connector, 'offload.connector')} "
           f"{d.obj(cs, 'offload.scheduler')}",
           f"manager free_chunks={free} {d.obj(manager, 'offload.manager')}"]
    out += _policy(d, policy, ranks)
    out += _requests(d, cs, blocks, nxt, manager, policy, ranks)
    out += _jobs(d, cs, blocks, nxt)
    if session.connector is not None:
        out += _worker(d, session.connector, nxt, worker)
    out.append("filed " + d.enc(sorted((r, n) for r, n in engine._named.items()
                                       if r in sched.requests), "engine._named"))
    return out
