"""A hit's shortfall in words: in the units that cause misses, and by group.

One definition for every report that says why a hit differs (the check, the
live recorder's three-way agreement, explain's tables), kept in ``traces`` so
the recorder, which runs inside a serving vLLM, needs nothing of the checker.
"""

from __future__ import annotations

from typing import Any

from traces.model.engine_spec import EngineBlock
from traces.model.outcome import RequestOutcome


def explain_gap(expected: int, actual: int, engine: EngineBlock) -> str:
    """Say the shortfall in the units that cause misses: blocks and PMUs."""
    gap = expected - actual
    if gap == 0:
        return ""
    word = "short" if gap > 0 else "over"
    gap = abs(gap)
    parts = []
    block = engine.block_size
    pmu = engine.prefix_match_unit or block
    if block and gap % block == 0:
        parts.append(f"{gap // block} block(s) of {block}")
    if pmu and pmu != block and gap % pmu == 0:
        parts.append(f"{gap // pmu} prefix-match unit(s) of {pmu}")
    unit = f" = {' = '.join(parts)}" if parts else ""
    hint = ""
    if actual == 0 and expected > 0:
        hint = "; a full miss"
    return f"{word} by {gap} tokens{unit}{hint}"



def explain_groups(request: RequestOutcome | None,
                   kv_groups: list[dict[str, Any]] | None) -> str:
    """Which KV-cache group stopped the hit, from what each could serve alone."""
    if not request or not kv_groups or not request.group_hits:
        return ""
    hits = request.group_hits
    parts = []
    for g, h in zip(kv_groups, hits):
        drop = ", EAGLE drop applied" if g.get("eagle_drop") else ""
        parts.append(f"group {g['group']} ({g['kind']}{drop}) alone could hit {h}")
    low = min(hits)
    limiting = [g for g, h in zip(kv_groups, hits) if h == low]
    text = "; ".join(parts)
    if len(set(hits)) > 1:
        names = ", ".join(f"group {g['group']} ({g['kind']})" for g in limiting)
        text += f"; the hit stopped at {low}, where {names} stopped"
    return text
