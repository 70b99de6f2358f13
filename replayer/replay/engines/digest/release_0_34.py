"""The state digest for vLLM 0.34 (the 0.33 adapter's range): 0.33's
(:mod:`.release_0_33`), but for the prefix-cache map, the store worker's
registered regions and the offloading worker's registered KV caches.

Read from the 0.34.0 wheel's ``vllm/v1/core/block_pool.py``,
``kv_cache_utils.py``, ``v1/request.py``, ``sched/scheduler.py`` and the
MooncakeStore connector's ``store/worker.py``, the OffloadingConnector's
``offloading/{scheduler,worker,common}.py`` and ``v1/kv_offload/cpu/``. What
differs from 0.33:

* **The prefix-cache map holds block ids.** ``BlockHashToBlockMap._cache``
  maps a hash key to one physical block id (the block ``get_one_block`` hands
  out), and ``_dup_ids`` lists, in insertion order, every id of a key several
  blocks hold; ``_blocks`` is the pool's block list. The section writes each
  key's blocks by label, the one handed out first, as 0.33's writes its blocks
  in its map's order.
* The block pool keeps a weak reference to itself (``_weak_self``), which each
  block's ``pool`` holds: left out, as ``pool`` is.
* A request's tokens are a ``TokenBuffer`` (an ``array`` of int32): the walker
  hashes its contents (:mod:`.walk`), never its (empty) fields.
* **The store worker keeps its KV caches' addresses.** ``MooncakeStoreWorker``
  maps each memory region it registered with the store, by its address, to
  its length (``_device_regions``), and keeps the addresses it unregistered
  for sleep mode (``_released_regions``). An address is where this process's
  allocator put a tensor, different in every engine built (walked, it failed
  every store trace's boundary); nothing reads it but the store's
  ``register_buffer`` and ``unregister_buffer`` in ``unregister_kv_caches`` /
  ``restore_kv_caches`` (sleep mode, which no replay enters), which hand it
  back for the same tensor, so no hit, put or get depends on it. The worker
  line writes the lengths in registration order and the released regions by
  their place in it (:data:`WORKER_BY_CONTENT`); both are still compared.

* **The offloading worker keeps the KV caches it registered.**
  ``OffloadingConnectorWorker._kv_caches`` (a ``CanonicalKVCaches``: tensors
  and each group's references into them) is read only by
  ``resolve_device_pointers``, which turns a transfer's block ids into
  addresses for the transfer handler (the seam: it moves no bytes, or copies
  them on the model worker); no lookup, store or eviction reads it. The worker
  line writes each tensor by shape, dtype and page size, never its address or
  bytes, and walks the group references (:func:`_offload_worker`). Its
  ``_connector_worker_meta`` now lists failed jobs (``failed_jobs``): written
  by distance from the next job, as completed ones are; ``_failed_recving`` is
  walked, as are the scheduler side's new fields (a job's ``failed``, a
  request's ``load_failed``, ``use_lookahead_block_hashes``) and the CPU
  tier's ``counted_keys`` per request.

0.34's lookup client (``LookupKeyClient``: a non-blocking lookup's result
reused for ``lookup_prefetch_ttl_s`` of wall time, prefetches on arrival)
is never in a replay: the scheduler-side connector's ``client`` is the
replayer's in-process lookup (left out in :mod:`.store`, the ZMQ seam), which
holds no result between calls and declines every prefetch, and a trace
asking for ``lookup_async`` is refused on 0.34 before an engine is built
(``refuse_wall_clock_lookups`` in the 0.33 adapter). So no wall-clock cache
is in the state, and none needs digesting.

The scheduler's new fields (``async_kv_waiting``, ``_parked_reservations``,
``_aborted_kv_loads``, the cache-aware admission settings) are walked unasked;
a field the digest reads that 0.34 lacks fails the boundary (never trusted).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from replayer.replay.engines.digest.release_0_33 import (
    EXCLUDED,
    DigestError,
    counters,
    state_sections,
)
from replayer.replay.engines.digest.walk import sha

# The offloading worker's fields its line writes by content, not walked.
OFFLOAD_WORKER_BY_CONTENT = frozenset(("_kv_caches",))

__all__ = ["DIGEST", "DigestError", "EXCLUDED", "counters", "state_digest"]


def _prefix_cache(d: Any, pool: Any) -> list[str]:
    """The prefix-cache map: hash key -> the block handed out, then every block
    holding it in the map's order (labels, never physical ids)."""
    cached = pool.cached_block_hash_to_block
    cache, dups = cached._cache, cached._dup_ids
    if not isinstance(cache, dict) or not isinstance(dups, dict):
        raise DigestError("block_pool.cached_block_hash_to_block: not 0.34's map of block ids")
    entries = []
    for key in sorted(cache, key=bytes):
        ids = list(dups[key]) if key in dups else [cache[key]]
        held = " ".join(d.block(pool.blocks[i]) for i in ids)
        entries.append(f"{bytes(key).hex()} {d.block(pool.blocks[cache[key]])} [{held}]")
    extra = sorted(f"{d.block(pool.blocks[i])} "
                   + " ".join(sorted(bytes(k).hex() for k in keys))
                   for i, keys in pool.cached_block_hashes_by_block.items())
    watched = sorted(d.block(pool.blocks[i]) for i in pool._reuse_watchers)
    return [f"{len(cache)} keys", *entries, *extra, d.obj(cached, "cached_block_hash_to_block"),
            d.obj(pool, "block_pool"), f"reuse_watchers {' '.join(watched)}"]


# MooncakeStoreWorker's fields the store section writes by content, not walked.
WORKER_BY_CONTENT: dict[str, str] = {
    "_device_regions": "KV-cache regions registered with the store, address -> length: "
                       "the address is the allocator's (handed back only to the store's "
                       "register/unregister_buffer for sleep mode), written as the "
                       "lengths in registration order",
    "_released_regions": "regions unregistered for sleep mode, by address: written as "
                         "their places in the registration order",
}


def _worker(d: Any, w: Any, path: str) -> str:
    """A rank's worker-side connector: its regions by content, then every other field."""
    regions = getattr(w, "_device_regions", None)
    released = getattr(w, "_released_regions", None)
    if not isinstance(regions, dict) or not isinstance(released, set) \
            or not released <= regions.keys():
        raise DigestError(f"{path}: not 0.34's registered regions (_device_regions, "
                          "_released_regions)")
    order = list(regions)
    places = sorted(order.index(a) for a in released)
    return (f"regions {list(regions.values())} released {places} "
            + d.canon.obj(w, path, also_skip=frozenset(WORKER_BY_CONTENT)))


def _offload_worker(d: Any, w: Any, path: str, nxt: int) -> str:
    """The OffloadingConnector's worker side: its registered KV caches by shape,
    dtype and page size, its failed jobs by distance, then every other field."""
    caches = getattr(w, "_kv_caches", None)
    failed = getattr(w._connector_worker_meta, "failed_jobs", None)
    if caches is None or not isinstance(failed, set):
        raise DigestError(f"{path}: not 0.34's registered KV caches (_kv_caches) and "
                          "failed jobs")
    tensors = " ".join(f"{tuple(t.tensor.shape)}:{t.tensor.dtype}:{t.page_size_bytes}"
                       for t in caches.tensors)
    refs = d.enc(caches.group_data_refs, f"{path}._kv_caches.group_data_refs")
    return (f"kv_caches [{tensors}] refs {refs} failed {sorted(nxt - j for j in failed)} "
            + d.canon.obj(w, path, also_skip=OFFLOAD_WORKER_BY_CONTENT))


def state_digest(engine: Any, loop: dict[str, int],
                 pending: Sequence[dict[str, Any]] = ()) -> dict[str, str]:
    """Each section's hash, and ``total`` over them all (as 0.33's)."""
    sections = state_sections(engine, loop, pending, prefix_cache=_prefix_cache,
                              worker=_worker, offload_worker=_offload_worker)
    parts = {name: sha(lines) for name, lines in sections.items()}
    parts["total"] = sha([f"{k}={v}" for k, v in parts.items()])
    return parts


# What the segment runner calls (one name per digest module).
DIGEST: Callable[..., dict[str, str]] = state_digest
