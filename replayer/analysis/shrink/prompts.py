"""Shorter prompts: whole blocks first, then prefix-match units.

Prefix caching sees blocks and prefix-match units, and a bug may live in a
residue (#51295 needs turn 1 exactly one token past a block boundary), so
cuts come coarse first and keep residues: whole blocks from a prompt's tail
(its length modulo the block stays), whole blocks from the head of a prefix
a group of prompts shares (every member's residue stays). Only then cuts of
prefix-match units (never single tokens), each kept only if the property
still holds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from replayer.analysis.shrink.case import Case
from replayer.analysis.shrink.prop import Prober
from replayer.analysis.shrink.search import largest_passing


def levels(case: Case) -> list[int]:
    """Cut granularities, coarse to fine: the largest block, then the prefix-match unit.

    No single-token level: prefix caching only sees whole units, and a token
    level cost a probe per halving of every prompt (170 probes on #51295)
    for cuts of less than a unit."""
    eng = case.engine
    block = max(g.block_size for g in eng.kv_groups)
    unit = eng.prefix_match_unit or block
    return sorted({block, unit}, reverse=True)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def head_groups(case: Case, unit: int) -> list[tuple[list[str], int]]:
    """Requests whose prompts start with the same ``unit`` tokens, and the prefix
    all of them share (groups of two or more, in arrival order)."""
    groups: dict[bytes, list[str]] = {}
    by_id = case.by_id()
    for r in case.requests:
        if len(r.prompt) > unit:
            groups.setdefault(r.prompt[:unit].tobytes(), []).append(r.id)
    out = []
    for ids in groups.values():
        if len(ids) < 2:
            continue
        first = by_id[ids[0]].prompt
        common = min(_lcp(first, by_id[i].prompt) for i in ids[1:])
        out.append((ids, common))
    return out


def shrink_prompts(case: Case, prober: Prober, protect: set[str] = frozenset(),
                   on_keep: Callable[[Case], None] | None = None) -> Case:
    """Each level in turn: head cuts of shared prefixes, then tail cuts (latest
    request first: earlier prompts bound what later ones share)."""
    keep = on_keep or (lambda _c: None)
    for step in levels(case):
        for ids, common in head_groups(case, step):
            by_id = case.by_id()
            if not all(i in by_id for i in ids):
                continue
            shortest = min(len(by_id[i].prompt) for i in ids)
            count = min(common, shortest - 1) // step

            def head(k: int, ids=ids, base=case) -> Case:
                b = base.by_id()
                return base.with_prompts({i: b[i].prompt[k * step:] for i in ids})
            k = largest_passing(count, head, prober) if count else 0
            if k:
                case = head(k)
                keep(case)
        for rid in reversed(case.ids):
            length = len(case.by_id()[rid].prompt)
            count = (length - 1) // step

            def tail(k: int, rid=rid, base=case, length=length) -> Case:
                return base.with_prompts({rid: base.by_id()[rid].prompt[:length - k * step]})
            k = largest_passing(count, tail, prober) if count else 0
            if k:
                case = tail(k)
                keep(case)
    return case
