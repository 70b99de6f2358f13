"""A canonical digest of a vLLM 0.33 engine's state: everything its future depends on.

A time segment of a replay (:mod:`replayer.replay.segments`) starts from an
empty engine some trace time before its boundary; its outcomes count only if,
at the boundary, its engine is in the state the replay before it reached
there. This module says what "the state" is, by reading vLLM's own objects
(nothing here decides what vLLM would do):

* the scheduler's queues (waiting, running, and the others it keeps), in
  order, and every live request's own state: computed tokens, output
  tokens, status, preemptions, drafts, block hashes;
* the block pool: the free queue in eviction order (each block's hash keys,
  reference count and hashed tokens), the prefix-cache map (hash key to the
  blocks holding it, in vLLM's order), the blocks each request holds in each
  KV-cache group, and each single-type manager's own bookkeeping (the Mamba
  groups' state positions and checkpoints, the sliding-window groups' and
  every other manager's per-request tables);
* the scheduler's other fields, and the replayer's own state that carries
  forward (drafts the null model accepted per request, the per-group hits
  of a lookup not yet reported, the loop's idle counters).

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
matter). Everything else is compared as it is, so a field this module does not
know of can only make a boundary fail (the segment is then replayed again from
its predecessor), never let a wrong one pass.

Left out on purpose: configuration (the same trace gives the same on both
sides), the prefix-hash cache in front of vLLM's hasher (it returns what vLLM's
hasher would, so it changes no output: ``tests/test_shortcuts.py``), and the
per-request lookup numbers explain reads (counters, carried across a
boundary by :func:`counters`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from enum import Enum
from typing import Any, Callable

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

# Fields that are configuration or wiring (the same trace builds the same), or
# are walked in a section of their own, per object kind.
_SCHEDULER_SKIP = frozenset({
    "vllm_config", "scheduler_config", "cache_config", "lora_config", "kv_cache_config",
    "kv_events_config", "parallel_config", "observability_config", "structured_output_manager",
    "kv_event_publisher", "encoder_cache_manager", "kv_cache_manager", "connector",
    "ec_connector", "perf_metrics", "requests", "waiting", "running", "schedule",
    "update_from_output", "policy",
    # vLLM's own clocks: compared below, relative to each other.
    "current_step", "num_executed_steps", "last_prefill_step"})
_REQUEST_SKIP = frozenset({
    "sampling_params", "pooling_params", "lora_request", "_block_hasher",
    "output_token_ids", "all_token_ids",          # views of _output/_all_token_ids
    "prompt_token_ids",                           # the head of _all_token_ids
    "next_decode_eligible_step", "arrival_time"})
_CORE_SKIP = frozenset({
    "vllm_config", "model_executor", "structured_output_manager", "scheduler",
    "request_block_hasher", "step_fn", "aborts_queue"})
_MANAGER_SKIP = frozenset({"kv_cache_spec", "block_pool", "kv_cache_config",
                           "single_type_managers", "coordinator", "metrics_collector",
                           "get_computed_blocks", "empty_kv_cache_blocks",
                           "attention_groups", "new_block_ids"})


class _Canon:
    """Writes objects as canonical text: blocks by label, requests by id."""

    def __init__(self) -> None:
        self.labels: dict[int, int] = {}
        self.blocks: list[KVCacheBlock] = []
        self._seen: set[int] = set()

    def block(self, b: KVCacheBlock) -> str:
        if b.is_null:
            return "null"
        key = id(b)
        label = self.labels.get(key)
        if label is None:
            label = self.labels[key] = len(self.blocks)
            self.blocks.append(b)
        return f"B{label}"

    def enc(self, x: Any) -> str:
        if x is None or isinstance(x, (bool, int, float, str)):
            return repr(x)
        if isinstance(x, (bytes, bytearray)):
            return "h" + bytes(x).hex()
        if isinstance(x, Enum):
            return f"{type(x).__name__}.{x.name}"
        if isinstance(x, KVCacheBlock):
            return self.block(x)
        if isinstance(x, Request):
            return "R" + repr(x.request_id)
        if isinstance(x, (list, tuple, deque)):
            if x and type(x[0]) is int:
                try:                               # token lists: hashed, not spelled out
                    return (f"I{len(x)}:"
                            + hashlib.blake2b(array("q", x).tobytes(), digest_size=16).hexdigest())
                except (TypeError, OverflowError):
                    pass
            if x and type(x[0]) is bytes and all(type(v) is bytes for v in x):
                h = hashlib.blake2b(digest_size=16)     # block hashes: the same
                for v in x:
                    h.update(len(v).to_bytes(2, "little") + v)
                return f"H{len(x)}:{h.hexdigest()}"
            return "[" + ",".join(self.enc(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ",".join(f"{self.enc(k)}:{self.enc(v)}" for k, v in x.items()) + "}"
        if isinstance(x, (set, frozenset)):
            # In iteration order: vLLM may iterate one, and two equal sets with
            # different histories can iterate differently.
            return "{" + ",".join(self.enc(v) for v in x) + "}"
        if callable(x) and not hasattr(x, "__dict__") and not hasattr(x, "__slots__"):
            return "fn"
        return self.obj(x)

    def obj(self, x: Any, skip: frozenset[str] = frozenset()) -> str:
        """An object as its type and fields (each object once: a cycle is named)."""
        key = id(x)
        if key in self._seen:
            return f"<again {type(x).__name__}>"
        self._seen.add(key)
        fields = _fields(x)
        body = ",".join(f"{k}={self.enc(v)}" for k, v in fields if k not in skip)
        return f"{type(x).__name__}({body})"


def _fields(x: Any) -> list[tuple[str, Any]]:
    if hasattr(x, "__dict__"):
        return list(vars(x).items())
    out = []
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(x, name):
                out.append((name, getattr(x, name)))
    return out


def _sha(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


def state_sections(engine: Any, loop: dict[str, int]) -> dict[str, list[str]]:
    """The canonical text of ``engine``'s state, by section (one line per item).

    ``engine`` is the 0.33 adapter (:class:`~.vllm_0_33.Vllm033Engine`);
    ``loop`` the replay loop's own state at the pause (clock, idle counters)."""
    sched = engine.scheduler
    kvm = sched.kv_cache_manager
    coord = kvm.coordinator
    pool = kvm.block_pool
    c = _Canon()
    out: dict[str, list[str]] = {}
    out["clock"] = [f"{k}={v}" for k, v in sorted(loop.items())]

    # The block pool's free queue, front (evicted first) to back.
    free = pool.free_block_queue
    queue = []
    b = free.fake_free_list_head.next_free_block
    while b is not None and b is not free.fake_free_list_tail:
        queue.append(c.block(b))
        b = b.next_free_block
    out["free_queue"] = [f"{free.num_free_blocks} free", " ".join(queue)]

    # Per KV-cache group: the manager's tables (each request's blocks first).
    managers = []
    for i, m in enumerate(coord.single_type_managers):
        # Blocks allocated since vLLM last took them (for zeroing), by label.
        new = " ".join(c.block(pool.blocks[j]) for j in m.new_block_ids)
        managers.append(f"group {i} {type(m).__name__} new=[{new}] "
                        + c.obj(m, _MANAGER_SKIP))
    out["kv_managers"] = [c.obj(kvm, _MANAGER_SKIP), c.obj(coord, _MANAGER_SKIP), *managers]

    # The scheduler's queues in order, then every request it holds.
    out["queues"] = [f"waiting {c.enc(list(sched.waiting))}",
                     f"running {c.enc(list(sched.running))}"]
    now = sched.current_step
    reqs = []
    for rid, req in sched.requests.items():
        # Only whether a decode is due yet counts (``current_step <
        # next_decode_eligible_step`` in schedule()): how far ahead it lies.
        ahead = max(0, req.next_decode_eligible_step - now)
        reqs.append(f"{rid!r} ahead={ahead} " + c.obj(req, _REQUEST_SKIP))
    out["requests"] = reqs

    rest = c.obj(sched, _SCHEDULER_SKIP)
    since_prefill = None
    if sched.local_prefill_interval > 1:
        # schedule() compares (num_executed_steps + 1) - last_prefill_step with
        # the interval: any distance at or past it acts alike.
        since_prefill = min(sched.num_executed_steps - sched.last_prefill_step,
                            sched.local_prefill_interval)
    out["scheduler"] = [rest, f"since_prefill={since_prefill}"]

    # The prefix-cache map: hash key -> blocks holding it, in vLLM's order of them.
    cache = pool.cached_block_hash_to_block._cache
    entries = []
    for key in sorted(cache, key=bytes):
        held = cache[key]
        blocks = [held] if isinstance(held, KVCacheBlock) else list(held.values())
        entries.append(f"{bytes(key).hex()} {' '.join(c.block(x) for x in blocks)}")
    extra = sorted(f"{c.block(pool.blocks[i])} "
                   + " ".join(sorted(bytes(k).hex() for k in keys))
                   for i, keys in pool.cached_block_hashes_by_block.items())
    out["prefix_cache"] = [f"{len(cache)} keys", *entries, *extra,
                           f"events {c.enc(pool.kv_event_queue)}",
                           f"reuse_watchers {len(pool._reuse_watchers)}"]

    # The engine core around the scheduler (batch queue, pending aborts).
    core = engine.core
    out["engine_core"] = [c.obj(core, _CORE_SKIP), f"aborts {core.aborts_queue.qsize()}"]

    # The replayer's own state that carries forward.
    # Drafts accepted so far per live request (a finished one's count is never read).
    live = sched.requests
    mine = [f"verified {c.enc(sorted((r, n) for r, n in engine._verified.items() if r in live))}"]
    hits = getattr(engine, "group_hits", None)
    if hits is not None:
        mine.append(f"group_hits {c.enc(hits.hits)}")
    out["replayer"] = mine

    # Every block met above, by label: what it holds (never its physical id).
    rows = []
    for label, blk in enumerate(c.blocks):
        rows.append(f"B{label} ref={blk.ref_cnt} hash="
                    f"{None if blk.block_hash is None else bytes(blk.block_hash).hex()} "
                    f"tokens={blk.block_hash_num_tokens}")
    unmet = pool.num_gpu_blocks - 1 - len(c.blocks)
    out["blocks"] = [f"{len(c.blocks)} met, {unmet} held elsewhere", *rows]
    return out


def state_digest(engine: Any, loop: dict[str, int]) -> dict[str, str]:
    """Each section's hash, and ``total`` over them all."""
    sections = state_sections(engine, loop)
    parts = {name: _sha(lines) for name, lines in sections.items()}
    parts["total"] = _sha([f"{k}={v}" for k, v in parts.items()])
    return parts


def counters(engine: Any) -> dict[str, int]:
    """Counters that number things from the engine's start, which a boundary
    carries over by offset: prefix lookups so far (explain orders by them)."""
    hits = getattr(engine, "group_hits", None)
    return {"lookups": 0 if hits is None else hits._count}


# What the segment runner calls (one name per digest module).
DIGEST: Callable[[Any, dict[str, int]], dict[str, str]] = state_digest
