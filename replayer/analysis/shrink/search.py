"""Deterministic searches over candidates: ddmin, and the largest cut that passes.

Both ask :class:`~.prop.Prober` for the lowest passing index of a batch, so
their answers are those of a one-at-a-time search whatever the timing.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from replayer.analysis.shrink.case import Case
from replayer.analysis.shrink.prop import Prober

T = TypeVar("T")


def _chunks(items: Sequence[T], n: int) -> list[list[T]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return [c for c in out if c]


def ddmin(items: Sequence[T], build: Callable[[list[T]], Case], prober: Prober,
          on_keep: Callable[[list[T]], None] | None = None) -> list[T]:
    """Zeller's delta debugging: a 1-minimal subset of ``items`` whose case passes.

    ``build(kept)`` makes the candidate; the full set is known to pass. Each
    round's candidates (every chunk, then every complement) are evaluated
    side by side, and the lowest index that passes wins."""
    kept = list(items)
    n = 2
    while kept:
        chunks = _chunks(kept, min(n, len(kept)))
        subsets = chunks if len(chunks) > 2 else []          # with 2, subsets are complements
        complements = [[x for x in kept if x not in c] for c in chunks]
        cands = subsets + complements
        hit = prober.first_passing([build(c) for c in cands])
        if hit is None:
            if len(chunks) >= len(kept):
                break                                        # each single removal fails
            n = min(2 * len(chunks), len(kept))
            continue
        kept = cands[hit]
        if on_keep:
            on_keep(kept)
        n = 2 if hit < len(subsets) else max(len(chunks) - 1, 2)
    return kept


def largest_passing(count: int, build: Callable[[int], Case], prober: Prober) -> int:
    """The largest ``i`` in ``0..count`` whose case passes, ``build(0)`` known to pass
    (a k-ary search: a batch of points at a time, assuming bigger is harder;
    only a passing point is ever returned)."""
    lo, hi = 0, count + 1                   # lo passes; hi is taken as failing
    while hi - lo > 1:
        width = hi - lo - 1
        k = min(prober.batch, width)
        points = sorted({lo + max(1, (width * (j + 1)) // (k + 1)) for j in range(k)}
                        | ({hi - 1} if k == width else set()))
        points = [p for p in points if lo < p < hi]
        oks = prober.all_of([build(p) for p in points])
        passing = [p for p, ok in zip(points, oks) if ok]
        if passing:
            lo = max(passing)
        failing = [p for p, ok in zip(points, oks) if not ok and p > lo]
        hi = min(failing) if failing else hi
        if not passing and not failing:
            break
    return lo
