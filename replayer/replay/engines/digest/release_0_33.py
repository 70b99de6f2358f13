"""A canonical digest of a vLLM 0.33 engine's state: everything its future depends on.

A time segment of a replay (:mod:`replayer.replay.segments`) starts from an
empty engine some trace time before its boundary; its outcomes count only if,
at the boundary, its engine is in the state the replay before it reached
there. This module says what "the state" is, by reading vLLM's own objects
(nothing here decides what vLLM would do).

The objects are walked by structure (:mod:`.walk`): every field of the
scheduler and each request it holds, the KV-cache manager, its coordinator and
single-type managers, the block pool (free queue in eviction order, the
prefix-cache map, each block's hash, reference count and hashed tokens), the
engine core, and the replayer's own state around them (the adapter, its
per-group hits). A field is left out only where :data:`EXCLUDED` names it,
with its reason; a field added to any of these classes is in the digest the
day it appears, and a value the walker cannot encode raises
:class:`~.walk.DigestError`, so the boundary is not trusted (the
segment before replays on into it).

Physical block ids are left out: a block is named by where the digest first
meets it (the free queue front to back, then each request's tables), so two
engines whose pools differ only by which physical block holds what digest
alike. That no decision depends on the ids themselves is checked by
``tests/test_segments.py`` (a replay over a permuted pool gives the same
bytes and digests).

Clocks vLLM counts from its own start are compared where they matter:
``current_step`` only as how far a request's ``next_decode_eligible_step``
lies ahead of it, ``num_executed_steps`` only as the distance since
``last_prefill_step`` (and only where ``local_prefill_interval`` makes it
matter). Counters explain reads (prefix lookups so far) are carried across a
boundary by :func:`counters`.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from replayer.replay.engines.digest import events as digest_events
from replayer.replay.engines.connector.pd_pair import PrefillDecodePair
from replayer.replay.engines.digest import offload as digest_offload
from replayer.replay.engines.digest import pair as digest_pair
from replayer.replay.engines.digest import store as digest_store
from replayer.replay.engines.digest.walk import Canon, DigestError, sha

__all__ = ["DIGEST", "DigestError", "EXCLUDED", "counters", "state_digest", "state_sections"]

_CONFIG = "configuration: the same trace builds the same on both sides"
_OWN = "walked in a section of its own"
_PHYSICAL = ("a physical block id: no decision depends on which block holds what "
             "(tests/test_segments.py replays over a permuted pool)")
_CLOCK = "a clock counted from the engine's start: compared relative to another below"
_VIEW = "a view of another field that is walked"
_TIMER = "the replayer's timer around vLLM's method (the method itself is code)"
_HASHER = ("the replayer's prefix-hash cache, in front of vLLM's block hasher: it returns "
           "what vLLM's hasher would (tests/test_shortcuts.py), whatever it holds")
_COUNT = "counts from the engine's start that explain reads: carried by counters()"
_NAMES = ("names of blocks by the first request that held their prefix: output only, "
          "named again by the head from the exact path's namings (segments/rows.py)")

# Every field the digest leaves out, by class (an object's class or any base),
# and why. Anything not named here is walked.
EXCLUDED: dict[str, dict[str, str]] = {
    "Scheduler": {
        **dict.fromkeys(("vllm_config", "scheduler_config", "cache_config", "lora_config",
                         "kv_cache_config", "kv_events_config", "parallel_config",
                         "observability_config"), _CONFIG),
        "structured_output_manager": "structured output: no trace request asks for it; "
                                     "its grammar backend and bitmask tensors are wiring",
        "kv_event_publisher": "where KV-cache events go: vLLM's null publisher behind the "
                              "replayer's collector (walked with the adapter)",
        "_free_request": "the KV-event collector's hook around vLLM's method (code)",
        "kv_cache_manager": _OWN, "requests": _OWN, "waiting": _OWN, "running": _OWN,
        "schedule": _TIMER, "update_from_output": _TIMER,
        "current_step": _CLOCK, "num_executed_steps": _CLOCK, "last_prefill_step": _CLOCK},
    "Request": {
        "sampling_params": _CONFIG, "pooling_params": _CONFIG, "lora_request": _CONFIG,
        "_block_hasher": _HASHER,
        "output_token_ids": _VIEW, "all_token_ids": _VIEW,        # of _output/_all_token_ids
        "prompt_token_ids": _VIEW,                                # the head of _all_token_ids
        "next_decode_eligible_step": _CLOCK,
        "arrival_time": "the wall clock at arrival (a replay's is 0.0; no decision reads it)"},
    "EngineCore": {
        "vllm_config": _CONFIG,
        "model_executor": "the null model: its outputs are the trace's, held by the adapter "
                          "(walked); its KV-cache configs are configuration",
        "structured_output_manager": "the scheduler's, left out there",
        "scheduler": _OWN,
        "request_block_hasher": _HASHER,
        "step_fn": "code: EngineCore.step, bound at start-up",
        "aborts_queue": "a queue.Queue: its pending aborts are written beside it"},
    "KVCacheManager": {
        "kv_cache_config": _CONFIG, "coordinator": _OWN, "block_pool": _OWN,
        "get_computed_blocks": "the replayer's per-group hit recorder around vLLM's method "
                               "(its pending hits are walked with the adapter)"},
    "KVCacheCoordinator": {
        "kv_cache_config": _CONFIG, "kv_cache_spec": _CONFIG, "block_pool": _OWN,
        "single_type_managers": _OWN,
        "attention_groups": _CONFIG + " (each group's spec and manager class)"},
    "SingleTypeKVCacheManager": {
        "kv_cache_spec": _CONFIG, "block_pool": _OWN,
        "new_block_ids": "physical block ids: written beside the manager as block labels"},
    "BlockPool": {
        "blocks": _PHYSICAL + "; every block met is written in the blocks section",
        "free_block_queue": _OWN, "cached_block_hash_to_block": _OWN,
        "cached_block_hashes_by_block": _OWN + " (keyed by physical id: written by label)",
        "null_block": "the one placeholder block, fixed at start-up",
        "_reuse_watchers": "keyed by physical id, to connector callbacks: the watched "
                           "blocks are written by label",
        "_weak_self": "0.34: a weak reference to the pool itself (each block's pool)"},
    "BlockHashToBlockMap": {"_cache": _OWN + " (sorted by key)",
                            "_dup_ids": _OWN + " (0.34: every block id of a key, by label)",
                            "_blocks": "0.34: the pool's block list (physical ids)"},
    "FreeKVCacheBlockQueue": {"fake_free_list_head": _OWN + " (the queue in order)",
                              "fake_free_list_tail": _OWN + " (the queue in order)"},
    "KVCacheBlock": {"block_id": _PHYSICAL, "pool": "the pool it belongs to (walked)",
                     "prev_free_block": _OWN + " (the free queue in order)",
                     "next_free_block": _OWN + " (the free queue in order)"},
    # The replayer's adapter around the engine (replay/engines/core_driver.py).
    "CoreEngine": {
        "config": _CONFIG, "layer_specs": _CONFIG, "info": _CONFIG, "num_spec": _CONFIG,
        "wants_logprobs": _CONFIG, "_hash_block_size": _CONFIG,
        "core": _OWN, "scheduler": _OWN, "_schedule": _TIMER, "_update": _TIMER,
        "prefix_hashes": _HASHER,
        "_step": "the adapter's step clock from its start (the loop's clock is compared)",
        "_accepted": "the recorded steps table, read from the trace (each segment's part "
                     "holds its own requests' rows)",
        "_verified": "written below for live requests only (a finished one's is never read)",
        "_outputs": "the trace's output tokens: written below for live requests only",
        "_sampled": "reset by the next step's model output before anything reads it",
        "notes": "said at the end, merged from every segment; no decision reads them",
        "group_hits": _OWN,
        "evictor": _OWN + " (events: the block hashes of each request an evict to come names)",
        "_evict_targets": "the requests the part's evict events name (those to come are "
                          "written in the events section)"},
    "GroupHits": {"coordinator": "the KV-cache manager's (walked)",
                  "kinds": _CONFIG, "eagle": _CONFIG,
                  "lookups": _COUNT, "_count": _COUNT},
    # The KV-event collector (replay/kv_events.py): what it carries forward is its
    # requests freed since the last publish (walked) and how many hashes of each
    # live one it indexed (written with the adapter).
    "KvEventCollector": {
        "scheduler": "vLLM's scheduler (walked)", "step": "code: the adapter's step clock",
        "sink": "code: where rows go", "hbs": _CONFIG, "_ext": "code: vLLM's hash conversion",
        "rows": "output: the events published so far (the head assembles them)",
        "first": _NAMES, "name_log": _NAMES, "row_names": _NAMES,
        "_order": "the rows' numbering from the engine's start (the head numbers them)",
        "_indexed": "written with the adapter for live and just-freed requests"},
    # A MooncakeStore connector's objects (digest/store.py says why), and vLLM's
    # OffloadingConnector's (digest/offload.py).
    **digest_store.EXCLUDED,
    **digest_offload.EXCLUDED,
    # A prefill/decode pair's adapter (digest/pair.py).
    **digest_pair.EXCLUDED,
}


class _Digest:
    """One digest's walk: blocks get labels in the order it first meets them."""

    def __init__(self) -> None:
        self.labels: dict[int, int] = {}
        self.blocks: list[KVCacheBlock] = []
        self.canon = Canon(EXCLUDED, {KVCacheBlock: self.block, Request: _request_ref})

    def block(self, b: KVCacheBlock) -> str:
        if b.is_null:
            return "null"
        label = self.labels.get(id(b))
        if label is None:
            label = self.labels[id(b)] = len(self.blocks)
            self.blocks.append(b)
        return f"B{label}"

    def enc(self, x: Any, path: str) -> str:
        return self.canon.enc(x, path)

    def obj(self, x: Any, path: str) -> str:
        return self.canon.obj(x, path)


def _request_ref(r: Request) -> str:
    return "R" + repr(r.request_id)


def _free_queue(d: _Digest, pool: Any) -> list[str]:
    """The free queue, front (evicted first) to back."""
    free = pool.free_block_queue
    queue = []
    b = free.fake_free_list_head.next_free_block
    while b is not None and b is not free.fake_free_list_tail:
        queue.append(d.block(b))
        b = b.next_free_block
    return [d.obj(free, "free_block_queue"), " ".join(queue)]


def _managers(d: _Digest, kvm: Any) -> list[str]:
    """The KV-cache manager, its coordinator, and each group's manager (each
    request's blocks first met here, after the free queue)."""
    coord = kvm.coordinator
    pool = kvm.block_pool
    out = [d.obj(kvm, "kv_cache_manager"), d.obj(coord, "coordinator")]
    for i, m in enumerate(coord.single_type_managers):
        # Blocks allocated since vLLM last took them (for zeroing), by label.
        new = " ".join(d.block(pool.blocks[j]) for j in m.new_block_ids)
        out.append(f"group {i} new=[{new}] " + d.obj(m, f"single_type_managers[{i}]"))
    return out


def _requests(d: _Digest, sched: Any) -> list[str]:
    now = sched.current_step
    out = []
    for rid, req in sched.requests.items():
        # Only whether a decode is due yet counts (``current_step <
        # next_decode_eligible_step`` in schedule()): how far ahead it lies.
        ahead = max(0, req.next_decode_eligible_step - now)
        out.append(f"{rid!r} ahead={ahead} " + d.obj(req, f"requests[{rid!r}]"))
    return out


def _scheduler(d: _Digest, sched: Any) -> list[str]:
    since_prefill = None
    if sched.local_prefill_interval > 1:
        # schedule() compares (num_executed_steps + 1) - last_prefill_step with
        # the interval: any distance at or past it acts alike.
        since_prefill = min(sched.num_executed_steps - sched.last_prefill_step,
                            sched.local_prefill_interval)
    return [d.obj(sched, "scheduler"), f"since_prefill={since_prefill}"]


def _prefix_cache(d: _Digest, pool: Any) -> list[str]:
    """The prefix-cache map: hash key -> blocks holding it, in vLLM's order of them."""
    cached = pool.cached_block_hash_to_block
    cache = cached._cache
    entries = []
    for key in sorted(cache, key=bytes):
        held = cache[key]
        blocks = [held] if isinstance(held, KVCacheBlock) else list(held.values())
        entries.append(f"{bytes(key).hex()} {' '.join(d.block(x) for x in blocks)}")
    extra = sorted(f"{d.block(pool.blocks[i])} "
                   + " ".join(sorted(bytes(k).hex() for k in keys))
                   for i, keys in pool.cached_block_hashes_by_block.items())
    out = [f"{len(cache)} keys", *entries, *extra, d.obj(cached, "cached_block_hash_to_block"),
           d.obj(pool, "block_pool")]
    if hasattr(pool, "_reuse_watchers"):            # vLLM 0.30 on
        watched = sorted(d.block(pool.blocks[i]) for i in pool._reuse_watchers)
        out.append(f"reuse_watchers {' '.join(watched)}")
    return out


def _replayer(d: _Digest, engine: Any) -> list[str]:
    """The replayer's own state that carries forward: the adapter's fields, the
    drafts verified and output tokens of each live request, pending per-group hits."""
    live = engine.scheduler.requests
    out = [d.obj(engine, "engine"),
           "verified " + d.enc(sorted((r, n) for r, n in engine._verified.items() if r in live),
                               "engine._verified"),
           "outputs " + d.enc([(r, engine._outputs[r]) for r in live if r in engine._outputs],
                              "engine._outputs")]
    hits = getattr(engine, "group_hits", None)
    if hits is not None:
        out.append(d.obj(hits, "engine.group_hits"))
    events = engine._kv_events
    if events is not None:
        indexing = set(live) | {r.request_id for r in events._freed}
        out.append("kv_events indexed " + d.enc(
            sorted((r, n) for r, n in events._indexed.items() if r in indexing),
            "engine._kv_events._indexed"))
    return out


def _blocks(d: _Digest, pool: Any) -> list[str]:
    """Every block met above, by label: what it holds (never its physical id)."""
    rows = [f"B{label} " + d.obj(blk, f"block B{label}") for label, blk in enumerate(d.blocks)]
    unmet = pool.num_gpu_blocks - 1 - len(d.blocks)
    return [f"{len(d.blocks)} met, {unmet} held elsewhere", *rows]


def state_sections(engine: Any, loop: dict[str, int], pending: Any = None, *,
                   scheduler: Callable[[_Digest, Any], list[str]] = _scheduler,
                   prefix_cache: Callable[[_Digest, Any], list[str]] = _prefix_cache,
                   pair_part: str | None = None,
                   worker: Callable[[_Digest, Any, str], str] | None = None,
                   offload_worker: Callable[[_Digest, Any, str, int], str] | None = None,
                   ) -> dict[str, list[str]]:
    """The canonical text of ``engine``'s state, by section (one line per item).

    ``engine`` is the 0.33 adapter (:class:`~.vllm_0_33.Vllm033Engine`);
    ``loop`` the replay loop's own state at the pause (clock, idle counters);
    ``pending`` what the replay has still to run (:class:`.events.Pending`);
    ``scheduler`` and ``prefix_cache``: those sections' writers (an earlier
    release's, :mod:`.release_0_29`, where its fields differ); ``worker``: how
    the store section writes a rank's worker-side connector (None: walked;
    0.34's, :mod:`.release_0_34`, writes its registered regions by content);
    ``offload_worker``: how the offload section writes the OffloadingConnector's
    worker side (None: walked; 0.34's writes its registered KV caches by content).
    A prefill/decode pair is written by :mod:`.pair`, each instance by this
    function (``pair_part``: which instance it is).
    Raises :class:`DigestError` on a value it cannot encode."""
    if isinstance(engine, PrefillDecodePair):
        return digest_pair.pair_sections(
            engine, pending,
            lambda one, part_pending, part: state_sections(
                one, loop, part_pending, scheduler=scheduler, prefix_cache=prefix_cache,
                pair_part=part, worker=worker, offload_worker=offload_worker),
            _Digest())
    sched = engine.scheduler
    kvm = sched.kv_cache_manager
    core = engine.core
    d = _Digest()
    out: dict[str, list[str]] = {"clock": [f"{k}={v}" for k, v in sorted(loop.items())]}
    out["free_queue"] = _free_queue(d, kvm.block_pool)
    out["kv_managers"] = _managers(d, kvm)
    out["queues"] = [f"waiting {d.enc(sched.waiting, 'scheduler.waiting')}",
                     f"running {d.enc(sched.running, 'scheduler.running')}"]
    out["requests"] = _requests(d, sched)
    out["scheduler"] = scheduler(d, sched)
    out["prefix_cache"] = prefix_cache(d, kvm.block_pool)
    out["engine_core"] = [d.obj(core, "engine_core"),
                          "aborts " + d.enc(list(core.aborts_queue.queue), "aborts_queue")]
    out["replayer"] = _replayer(d, engine)
    if getattr(getattr(engine, "session", None), "backend", None) == "cpu":
        how = {} if offload_worker is None else {"worker": offload_worker}
        out["offload"] = digest_offload.offload_section(d, engine, **how)  # connector: offloading
    else:
        how = {} if worker is None else {"worker": worker}
        store = (digest_store.store_section(d, engine, **how) if pair_part is None
                 else digest_store.store_section(d, engine, pair_part, **how))
        if store:                              # a MooncakeStore trace's
            out["store"] = store
    events = digest_events.events_section(d, engine, pending)
    if events:                                 # targeted events to come
        out["events"] = events
    out["blocks"] = _blocks(d, kvm.block_pool)
    return out


def state_digest(engine: Any, loop: dict[str, int],
                 pending: Any = None) -> dict[str, str]:
    """Each section's hash, and ``total`` over them all."""
    sections = state_sections(engine, loop, pending)
    parts = {name: sha(lines) for name, lines in sections.items()}
    parts["total"] = sha([f"{k}={v}" for k, v in parts.items()])
    return parts


def counters(engine: Any) -> dict[str, int]:
    """Counters that number things from the engine's start, which a boundary
    carries over by offset: prefix lookups so far (explain orders by them)."""
    # A prefill/decode pair's lookups are its decode instance's (PrefillDecodePair.lookups).
    hits = getattr(getattr(engine, "decode", engine), "group_hits", None)
    return {"lookups": 0 if hits is None else hits._count}


# What the segment runner calls (one name per digest module).
DIGEST: Callable[..., dict[str, str]] = state_digest
