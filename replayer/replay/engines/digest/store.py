"""The MooncakeStore connector's part of a state digest (the store adapter's range, 0.29-0.33).

A store trace's replay carries more past a boundary than the engine's
scheduler and block pool: vLLM's scheduler-side connector (walked with the
scheduler: its load specs, request trackers, unfinished requests, pinned
saves), each rank's worker-side connector and its send and receive threads'
bookkeeping (which requests were stored, skipped under pressure, saved how
far), the store's contents in insertion order (the memory store evicts its
oldest objects first), and the replayer's own store state (how many hashes
of each live request were filed, the keys whose bytes a get is checked
against). :func:`store_section` writes them; :data:`EXCLUDED` names what it
leaves out, each with its reason, and is merged into the digest's own list.

Left out on purpose:

* **Names.** Which request first held a key's prefix is output, never read
  by vLLM; the head names every key from the exact path's filings
  (:mod:`replayer.replay.segments.rows`), so the engine's name map is not
  compared (the filing counts of live requests, which decide what is filed
  next, are).
* **The values' bytes.** The KV pages are deterministic noise per physical
  block, so which block a key was put from decides its bytes, and physical
  block ids are not state (the digest's rule). No decision reads them: a get
  succeeds on its size, and the recorder checks each get against the bytes
  its own replay put. Keys and sizes are written, in the store's order.
* **Job ids.** The scheduler numbers its store jobs from its start; the
  number is only a label matched for equality (pinned saves and their
  completions, written as they are: non-empty at a pause, they can only make
  a boundary fail).
* **Wiring.** Threads, locks, the lookup channel, metrics, configuration.
  Every queue a thread reads must be empty at a pause (the replay drains them
  each step); one that is not makes the boundary fail, never pass.

Only the memory store's contents can be read: a real master's
(``--store mooncake``) cannot, and such a replay stays in one piece
(:func:`replayer.replay.segments.worker.serial_reason`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from replayer.replay.engines.digest.walk import DigestError

_CONFIG = "configuration: the same trace builds the same on both sides"
_NAMES = ("names of keys by the first request that held their prefix: output only, "
          "named again by the head from the exact path's filings (segments/rows.py)")
_WIRING = "wiring: how the parts reach each other, no state of the replay"
_OWN = "written in the store section"
_METRICS = "metrics, handed to the stats logger and never read back by a decision"
_JOBS = ("a job number counted from the engine's start, only ever matched for "
         "equality: each job id held is written as its distance from it")
_JOBS_BY = _OWN + " (job ids as their distance from the scheduler's next one)"
_IDS = _OWN + " (physical block ids as the digest's block labels)"
_BYTES = ("bytes moved: KV pages of deterministic noise per physical block, which no "
          "decision reads (a get succeeds on its size)")

EXCLUDED: dict[str, dict[str, str]] = {
    # The scheduler-side connector (vLLM's; walked as a field of the scheduler).
    "KVConnectorBase_V1": {
        "_vllm_config": _CONFIG, "_kv_transfer_config": _CONFIG, "_kv_cache_config": _CONFIG,
        "_kv_cache_manager": "the KV-cache manager, walked in its own section",
        "_connector_metadata": "the step's metadata: set and cleared within a step",
        "_role": _CONFIG},
    "MooncakeStoreScheduler": {
        "client": "the lookup channel (the ZMQ seam, InProcessLookupClient): its store is "
                  "written in the store section",
        "kv_cache_config": _CONFIG,
        "_store_coord": _CONFIG + " (groups and margins, computed from the KV-cache "
                                  "config at start-up)",
        "_gpu_block_pool": "the block pool, walked in its own section",
        "_next_store_job_id": _JOBS,
        "_pinned_saves": _IDS, "_unfinished_requests": _IDS},
    "RequestTracker": {"allocated_block_ids": _IDS},
    # Each rank's worker-side connector (walked in the store section).
    "MooncakeStoreWorker": {
        "store": _OWN + " (the recorder and the store behind it)",
        "kv_send_thread": _OWN, "kv_recv_threads": _OWN,
        "recv_request_queue": _OWN + " (must be empty at a pause)",
        "lookup_server": _WIRING, "_kv_connector_stats_lock": _WIRING,
        "kv_connector_stats": _METRICS, "_mem_pool": _WIRING,
        "cache_config": _CONFIG, "_kv_cache_config": _CONFIG, "_kv_cache_groups": _CONFIG,
        "coord": _CONFIG, "token_dbs": _CONFIG, "store_replicate_config": _CONFIG,
        "_lookup_key_prefixes": _CONFIG, "kv_caches": _BYTES, "kv_caches_base_addr": _BYTES},
    "KVTransferThread": {
        "store": _OWN, "ready_event": _WIRING, "token_databases": _CONFIG,
        "_record_operation_cb": _WIRING, "done_task_lock": _WIRING, "kv_event_lock": _WIRING,
        "request_queue": _OWN + " (must be empty at a pause)", "coord": _CONFIG,
        "replicate_config": _CONFIG, "_invalid_block_ids_lock": _WIRING,
        "_handle_request": "the replayer's wrapper naming each load's request (code)",
        "stored_requests": _JOBS_BY, "_completed_saves": _JOBS_BY},
    # The thread's own machinery (whatever this Python calls it).
    "Thread": dict.fromkeys(vars(threading.Thread()), "the thread's own machinery"),
    # The replayer's own objects around them.
    "StoreConnectorEngine": {"session": _OWN, "boundaries": _NAMES, "name_log": _NAMES,
                             "_named": _OWN + " (live requests' counts)",
                             "_connector_step": "code: how the release's model runner "
                                                "steps a worker connector"},
    "InProcessLookupClient": {"session": _OWN},
    "Fault": {"step": "the engine step it was armed before, counted from the engine's "
                      "start: said in its note only (the head offsets it)"},
}


def _empty(q: Any, path: str) -> str:
    if q is not None and (q.unfinished_tasks or not q.empty()):
        raise DigestError(f"{path}: a queue with work in flight at the pause")
    return "empty"


def _store(d: Any, session: Any) -> list[str]:
    """The memory store's objects in insertion order (what it evicts first), by key
    and size; its fill and capacity."""
    memory = session._memory
    if session.spec.kind != "memory" or memory is None:
        raise DigestError(f"store {session.label}: the state digest reads the memory "
                          "store's contents only")
    objects = " ".join(f"{k}:{len(v)}" for k, v in memory.objects.items())
    return [f"store used={memory.used_bytes} capacity={memory.capacity_bytes} "
            f"{len(memory.objects)} objects", objects]


def _ops(d: Any, ops: Any) -> list[str]:
    """What the recorder's shared log carries forward: the keys a get is checked
    against (their sizes, in order), the faults still armed (one that fired its
    last acts no more); never failures (raised each step)."""
    if ops.failures:
        raise DigestError("store: failures not yet raised at the pause")
    sizes = " ".join(f"{k}:{','.join(map(str, v))}" for k, v in ops.put_sizes.items())
    armed = [f for f in ops.faults if f.fired < f.times]
    return ["checked " + " ".join(ops.put_crc), "sizes " + sizes,
            "faults " + d.enc(armed, "store.ops.faults")]


def _scheduler_side(d: Any, sched: Any) -> list[str]:
    """The scheduler-side connector's fields that hold physical block ids or job
    numbers, by label and by distance from the next job."""
    side = sched.connector.connector_scheduler
    blocks = sched.kv_cache_manager.block_pool.blocks
    nxt = side._next_store_job_id

    def labels(groups: Any) -> str:
        return "|".join(" ".join(d.block(blocks[i]) for i in ids) for ids in groups)

    return [
        # A finished request stays here until the next step: walked whole.
        "unfinished " + "; ".join(f"{rid!r} {d.obj(req, f'unfinished[{rid!r}]')} {labels(ids)}"
                                  for rid, (req, ids) in side._unfinished_requests.items()),
        "trackers " + "; ".join(f"{rid!r} {labels(t.allocated_block_ids)}"
                                for rid, t in side._request_trackers.items()),
        "pinned " + "; ".join(f"{nxt - job} {labels([ids])} {left}"
                              for job, (ids, left) in side._pinned_saves.items())]


def _jobs(by: dict[str, set[int]], nxt: int) -> str:
    """Each request's store jobs in flight, by distance from the next job number."""
    return "; ".join(f"{rid!r} {sorted(nxt - j for j in jobs)}" for rid, jobs in by.items())


def _worker(d: Any, w: Any, path: str) -> str:
    return d.obj(w, path)


def store_section(d: Any, engine: Any, pair_part: str | None = None,
                  worker: Callable[[Any, Any, str], str] = _worker) -> list[str]:
    """The store section's lines: [] for an engine without a MooncakeStore.
    ``pair_part``: the instance of a prefill/decode pair this engine is
    (:mod:`.pair`): the store and its log, which the two share, are written
    once, with the decode instance; each instance's connector with its own.
    ``worker``: how a rank's worker-side connector is written (a release's
    digest where its fields need more than the walk: 0.34's, :mod:`.release_0_34`)."""
    session = getattr(engine, "session", None)
    if session is None:
        if getattr(engine.scheduler, "connector", None) is not None:
            raise DigestError("scheduler.connector: a connector with no store session, "
                              "whose state the digest does not read")
        return []
    if not hasattr(session, "ranks"):
        raise DigestError(f"engine.session: a {type(session).__name__}, whose state the "
                          "digest does not read (a MooncakeStore connector's it does)")
    if session.gather is not None:
        raise DigestError("store: a gathered store session (ranks in processes of their "
                          "own), which the digest does not read")
    if (session.peer is not None) != (pair_part == "decode"):
        raise DigestError("store: a store shared with another engine (a prefill/decode "
                          "pair) read as one engine's")
    live = engine.scheduler.requests
    shared = [] if pair_part == "prefill" else _store(d, session) + _ops(d, session.ops)
    out = shared + _scheduler_side(d, engine.scheduler)
    nxt = engine.scheduler.connector.connector_scheduler._next_store_job_id
    out.append("filed " + d.enc(sorted((r, n) for r, n in engine._named.items() if r in live),
                                "engine._named"))
    if session._aggregator is not None:      # TP N: what each rank has reported so far
        out.append("aggregator " + d.obj(session._aggregator, "store.aggregator"))
    for one in session.ranks:
        w, rec, path = one.worker, one.recorder, f"rank{one.rank}"
        if rec.phase != "exists" or getattr(rec._loading, "request", None) is not None:
            raise DigestError(f"{path}.store: a lookup or load in flight at the pause")
        out.append(f"{path} recv_request_queue {_empty(w.recv_request_queue, path)}")
        out.append(f"{path} worker " + worker(d, w, f"{path}.worker"))
        threads = ([w.kv_send_thread] if w.kv_send_thread is not None else []) \
            + list(w.kv_recv_threads)
        for i, t in enumerate(threads):
            where = f"{path}.thread[{i}]"
            completed = {nxt - j: n for j, n in getattr(t, "_completed_saves", {}).items()}
            out.append(f"{where} {_empty(t.request_queue, where)} "
                       f"stored {_jobs(getattr(t, 'stored_requests', {}), nxt)} "
                       f"completed {completed} " + d.obj(t, where))
    return out
