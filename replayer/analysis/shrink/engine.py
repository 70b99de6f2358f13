"""The smallest scheduler and cache sizes that keep the property.

``num_gpu_blocks``, ``max_num_seqs`` and ``max_num_batched_tokens`` are what
make a reproducer depend on load; each is binary-searched down from the
value the replay used, no lower than vLLM builds (a vLLM that refuses to
build, or a replay that cannot finish, fails the probe).
``max_num_batched_tokens`` stops at the largest block: below it a long
prompt takes thousands of steps and the bug is rarely there. Block size,
prefix-match unit, groups and speculative method are the geometry of the bug
and are never touched.
"""

from __future__ import annotations

from typing import Callable

from replayer.analysis.shrink.case import Case
from replayer.analysis.shrink.prop import Prober
from replayer.analysis.shrink.search import largest_passing

KEYS = ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens")


def current(case: Case, key: str) -> int:
    """The value the replay runs with (vLLM's own default resolved)."""
    sized = case.to_trace().sized_engine()
    return int(getattr(sized, key))


def floor(case: Case, key: str) -> int:
    """The smallest value worth a probe. ``num_gpu_blocks``: vLLM refuses a pool
    that cannot hold one request of ``max_model_len`` in a full-attention group,
    so fewer blocks than that only spend probes on engines it will not build."""
    if key == "max_num_batched_tokens":
        return max(g.block_size for g in case.engine.kv_groups)
    if key == "num_gpu_blocks":
        full = [g.block_size for g in case.engine.kv_groups
                if g.kind in ("full_attention", "mla")]
        if full:
            length = case.to_trace().sized_engine().max_model_len
            return max(1, -(-length // max(full)))
    return 1


def shrink_engine(case: Case, prober: Prober,
                  on_keep: Callable[[Case], None] | None = None) -> tuple[Case, dict[str, tuple]]:
    """The case with each key at the smallest passing value; {key: (before, after)}."""
    changed: dict[str, tuple] = {}
    for key in KEYS:
        top = current(case, key)
        low = min(floor(case, key), top)

        def at(cut: int, base=case, key=key, top=top) -> Case:
            return base if cut == 0 else base.with_engine(**{key: top - cut})
        cut = largest_passing(top - low, at, prober)
        if cut:
            case = at(cut)
            changed[key] = (top, top - cut)
            if on_keep:
                on_keep(case)
    return case, changed
