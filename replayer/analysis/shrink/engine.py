"""The smallest scheduler and cache sizes that keep the property.

``num_gpu_blocks``, ``max_num_seqs`` and ``max_num_batched_tokens`` are what
make a reproducer depend on load; each is binary-searched down from the
value the replay used, no lower than vLLM builds (:func:`floor`; a replay
that cannot finish fails the probe).
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


def floor(case: Case, key: str, prober: Prober) -> int:
    """The smallest value worth a probe. ``num_gpu_blocks``: the fewest vLLM builds
    the engine with (one request of ``max_model_len`` in every KV-cache group,
    plus the null block), as the replays' own vLLM counts them
    (:mod:`replayer.replay.engines.capacity`), so no probe asks for an engine
    vLLM would refuse. An engine that does not tell: one ``max_model_len``
    request in the largest full-attention block, plus the null block."""
    if key == "max_num_batched_tokens":
        return max(g.block_size for g in case.engine.kv_groups)
    if key == "num_gpu_blocks":
        told = prober.gpu_blocks_floor(case)
        if told is not None:
            return told
        full = [g.block_size for g in case.engine.kv_groups
                if g.kind in ("full_attention", "mla")]
        if full:
            length = case.to_trace().sized_engine().max_model_len
            return -(-length // max(full)) + 1
    return 1


def shrink_engine(case: Case, prober: Prober,
                  on_keep: Callable[[Case], None] | None = None) -> tuple[Case, dict[str, tuple]]:
    """The case with each key at the smallest passing value; {key: (before, after)}."""
    changed: dict[str, tuple] = {}
    for key in KEYS:
        top = current(case, key)
        low = min(floor(case, key, prober), top)

        def at(cut: int, base=case, key=key, top=top) -> Case:
            return base if cut == 0 else base.with_engine(**{key: top - cut})
        cut = largest_passing(top - low, at, prober)
        if cut:
            case = at(cut)
            changed[key] = (top, top - cut)
            if on_keep:
                on_keep(case)
    return case, changed
