"""Before ddmin: cut away, in one or two probes, what cannot matter to the focus.

A request's hit is decided at its first prefill, so a request that reaches the
engine after the focus request's first prefill (on every engine the property
replays) cannot change the focus's hits: the first candidate drops them all,
with the events that fire after that step. The second also drops, of what is
left, every request whose prompt shares no block with the focus's prompt:
enough for a loss that comes from the prefix itself (the EAGLE drop, sparse
retention, a store resend), not for one that needs unrelated traffic (a
capacity loss), which is why it is a probe and not a rule. The smallest
candidate that keeps the property wins; ddmin then starts from it. On the
1,000-request conversation slice this replaces hundreds of ddmin probes over
requests that never met the focus.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replayer.analysis.shrink.case import Case


def _prefill_bound(verdict: Any, focus: str) -> tuple[int, dict[str, int]] | None:
    """The latest first prefill of ``focus`` over the engines replayed, and each
    request's arrival step there (None: the focus never prefilled)."""
    steps, arrivals = [], {}
    for result in verdict.results.values():
        out = result.by_id().get(focus)
        if out is None or out.prefill_step is None:
            return None
        steps.append(out.prefill_step)
        for o in result.requests:
            arrivals[o.id] = max(arrivals.get(o.id, o.arrival_step), o.arrival_step)
    return (max(steps), arrivals) if steps else None


def _shares_a_block(prompt: np.ndarray, focus: np.ndarray, block: int) -> bool:
    n = min(len(prompt), len(focus), block)
    return n == block and bool(np.array_equal(prompt[:block], focus[:block]))


def candidates(case: Case, verdict: Any, focus: str) -> list[Case]:
    """Smaller cases to try first, smallest first (empty: nothing to cut)."""
    bound = _prefill_bound(verdict, focus)
    if bound is None or focus not in case.ids:
        return []
    prefill, arrivals = bound
    late = {r.id for r in case.requests
            if r.id != focus and arrivals.get(r.id, 0) > prefill}
    late_events = {i for i, ev in enumerate(case.events)
                   if (ev.get("after") is None and (ev.get("at_step") or 0) > prefill)
                   or ev.get("after") in late}
    arrived = case.without(late, late_events)
    block = min(g.block_size for g in case.engine.kv_groups)
    focus_prompt = case.by_id()[focus].prompt
    apart = {r.id for r in arrived.requests
             if r.id != focus and not _shares_a_block(r.prompt, focus_prompt, block)}
    out = []
    if apart:
        out.append(arrived.without(apart))
    if late or late_events:
        out.append(arrived)
    return out


def relevance_cut(case: Case, verdict: Any, focus: str | None, prober: Any, keep) -> Case:
    """The smallest candidate that keeps the property, else ``case`` itself."""
    if focus is None:
        return case
    cands = candidates(case, verdict, focus)
    if not cands:
        return case
    hit = prober.first_passing(cands)
    if hit is None:
        return case
    keep(cands[hit])
    return cands[hit]
