"""Why a request hit what it hit: each KV-cache group's own longest hit (vLLM 0.33).

A hybrid model's prefix hit is what every group agrees on; a miss is the group
that stopped first. For the first lookup of each request this asks vLLM's own
``find_longest_cache_hit_per_group`` (a read-only lookup vLLM itself uses for
connectors) what each group alone could serve, with the EAGLE drop applied as
vLLM applies it, and keeps the answer beside the request's outcome.
"""

from __future__ import annotations

from typing import Any

from replayer.replay.engines.kv_kinds import spec_kind


class GroupHits:
    """Installs itself around the KV-cache manager's lookup; reads nothing else."""

    def __init__(self, scheduler: Any, step: Any = None) -> None:
        manager = scheduler.kv_cache_manager
        self.coordinator = manager.coordinator
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.kinds = [spec_kind(g.kv_cache_spec) for g in groups]
        # What vLLM applies, not what the specs flag: the coordinator keeps the
        # drop only without lookahead hashes, and flags every group when no
        # group holds the draft's layers (``drop_eagle_group_ids``).
        dropped = self.coordinator.drop_eagle_group_ids
        self.eagle = [i in dropped for i in range(len(groups))]
        self.hits: dict[str, list[int]] = {}
        # (engine step, lookup number) of each request's last lookup: the order
        # in which requests could see each other's prefixes.
        self.lookups: dict[str, tuple[int, int]] = {}
        self._count = 0
        step = step or (lambda: 0)
        original = manager.get_computed_blocks

        def get_computed_blocks(request, *args, **kwargs):
            out = original(request, *args, **kwargs)
            # The last lookup before the request is scheduled is the one that counts.
            self.hits[request.request_id] = self._per_group(request, out[1])
            self._count += 1
            self.lookups[request.request_id] = (step(), self._count)
            return out

        manager.get_computed_blocks = get_computed_blocks

    def _per_group(self, request, combined: int) -> list[int]:
        per_group = getattr(self.coordinator, "find_longest_cache_hit_per_group", None)
        if per_group is None or len(self.kinds) == 1:
            return [combined] * len(self.kinds)
        _, hits = per_group(request.block_hashes, request.num_tokens - 1)
        return [int(h) for h in hits]

    def take(self, request_id: str) -> tuple[int, ...] | None:
        hits = self.hits.pop(request_id, None)
        return tuple(hits) if hits is not None else None

    def forget(self, request_id: str) -> None:
        """A finished request's lookup is no longer needed (a streamed replay)."""
        self.lookups.pop(request_id, None)
        self.hits.pop(request_id, None)

    def describe(self) -> list[dict[str, Any]]:
        return [{"group": i, "kind": k, "eagle_drop": e}
                for i, (k, e) in enumerate(zip(self.kinds, self.eagle))]
