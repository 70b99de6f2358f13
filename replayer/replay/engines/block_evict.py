"""Targeted eviction of cached GPU blocks, through vLLM's own calls.

vLLM evicts chosen blocks from its prefix cache with
``KVCacheManager.evict_blocks(block_ids)`` (``BlockPool.evict_blocks`` ->
``_maybe_evict_cached_block``, which drops every cache entry of the block; a
block still in use keeps its data). The scheduler calls it for blocks a KV
connector failed to load; vLLM's tests pick the ids as the pool's cached
blocks of some KV-cache groups (``block.block_hash`` read with
``get_group_id``). This module only chooses the ids that way:

* ``group: G``: every block cached for group G.
* ``request: R``: every block cached under a prefix of R's tokens, in any
  group: each cache entry is ``(request.block_hashes[k], group)`` for full
  blocks, partial entries and Mamba checkpoints alike (``cache_full_blocks``,
  ``cache_partial_block``), so these are exactly the blocks a resend of R
  could hit. Blocks R shares with other requests' prefixes go too, as they
  would in vLLM.
* both: R's blocks of group G only.

The entries read are a block's primary hash and its extra entries
(``BlockPool.cached_block_hashes_by_block``). ``evict_blocks``,
``BlockPool.blocks``, ``cached_block_hashes_by_block``, ``get_group_id`` and
``get_block_hash`` are the same from vLLM 0.29 to 0.33, so every release
adapter shares this; an engine lacking them says so when asked to evict.
"""

from __future__ import annotations

from typing import Any

from replayer.replay.engines.base import UnsupportedByEngine


class BlockEvictor:
    """Chooses block ids for ``evict`` events and hands them to vLLM."""

    def __init__(self, scheduler: Any, version: str) -> None:
        manager = scheduler.kv_cache_manager
        pool = getattr(manager, "block_pool", None)
        if not hasattr(manager, "evict_blocks") or not hasattr(
                pool, "cached_block_hashes_by_block"):
            raise UnsupportedByEngine(f"vllm {version}: no KVCacheManager.evict_blocks or "
                                      "BlockPool.cached_block_hashes_by_block; evict events "
                                      "cannot be replayed on it")
        self.manager = manager
        self.pool = pool
        self.num_groups = len(scheduler.kv_cache_config.kv_cache_groups)
        # vLLM's Request objects of the requests evict events name: their
        # block_hashes (prompt and outputs) outlive the request.
        self.requests: dict[str, Any] = {}

    def track(self, request: Any) -> None:
        self.requests[request.request_id] = request

    def _entries(self, block: Any) -> list[Any]:
        extra = self.pool.cached_block_hashes_by_block.get(block.block_id, ())
        first = [] if block.block_hash is None else [block.block_hash]
        return first + list(extra)

    def choose(self, request: str | None, group: int | None) -> set[int]:
        """Ids of the cached blocks an event names (see the module docstring)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        if group is not None and group >= self.num_groups:
            raise ValueError(f"group {group}: vLLM has {self.num_groups} KV-cache group(s), "
                             f"numbered from 0")
        hashes = None
        if request is not None:
            hashes = set(self.requests[request].block_hashes)
        out = set()
        for block in self.pool.blocks:
            for entry in self._entries(block):
                if group is not None and get_group_id(entry) != group:
                    continue
                if hashes is not None and get_block_hash(entry) not in hashes:
                    continue
                out.add(block.block_id)
                break
        return out

    def evict(self, request: str | None, group: int | None) -> int:
        """Evict the chosen cached blocks with vLLM's call; how many there were."""
        ids = self.choose(request, group)
        self.manager.evict_blocks(ids)
        return len(ids)
