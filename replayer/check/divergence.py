"""How a hit's outputs are compared with its recompute's, and the threshold.

The comparison side of ``check --recompute`` (:mod:`.reference` makes what
is compared against): per compared position the difference of the two
computations, and the threshold above which a difference is a wrong hit.
"""

from __future__ import annotations

MARGIN = 4.0
FLOOR_ULPS = 4


def ulp32(x: float) -> float:
    """One float32 unit in the last place at ``x``."""
    import numpy as np

    return float(np.spacing(np.float32(abs(x) or 1.0)))


def threshold_for(tolerance: float, largest: float) -> float:
    return MARGIN * max(tolerance, FLOOR_ULPS * ulp32(largest))


def max_diff(a: list[float], b: list[float]) -> tuple[float, int | None, list[float]]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return (max(diffs) if diffs else 0.0), None, diffs
