"""Where a trace splits into time segments, and whether it can.

A segment ``k`` owns the arrivals in ``[t_k, t_(k+1))`` of the step clock and
starts from an empty engine at ``t_k - W`` (the warm-up ``W``; the first
segment starts at 0). Boundaries are arrival steps, so every boundary is a
point the replay's clock reaches in every segment that spans it.

Boundaries are placed so that each segment's work, warm-up included, is about
the same: work is estimated from the trace alone (:func:`work_by_step`), never
from a replay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from traces import Trace
from traces.model.errors import TraceError
from traces.model.step_clock import DEFAULT_STEP_MS

#: The warm-up when none is given: two minutes of trace time.
DEFAULT_WARM_UP = "2m"

# Estimated seconds of replay per unit (measured on the conversation hour, full
# attention at block 16, vLLM 0.33 on these machines; only their ratios matter):
# an engine step, a decode step of one request, a prompt token (hashing and
# block allocation).
STEP_COST = 4e-4
DECODE_COST = 1.2e-5
PROMPT_TOKEN_COST = 3e-7

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|steps?)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000}


@dataclass(frozen=True)
class Segment:
    """One time segment: it owns arrivals in ``[start, end)`` (``end`` None: to
    the end of the trace) and replays from ``warm_from``."""

    index: int
    start: int
    end: int | None
    warm_from: int

    @property
    def first(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class SegmentPlan:
    segments: tuple[Segment, ...]
    warm_up_steps: int
    warm_up_text: str
    asked: int                          # segments asked for (fewer when arrivals are few)
    estimated_work: tuple[float, ...]   # estimated seconds per segment (warm-up included)

    @property
    def boundaries(self) -> list[int]:
        return [s.start for s in self.segments[1:]]


def step_ms(trace: Trace) -> int:
    """Milliseconds of trace time per engine step (the default clock where the
    trace has none: a recorded trace's steps are its engine's)."""
    clock = trace.header.get("step_clock") or {}
    return int(clock.get("step_ms") or DEFAULT_STEP_MS)


def warm_up_steps(text: str, trace: Trace, where: str = "--warm-up") -> int:
    """``2m``, ``90s``, ``500ms``, ``1h`` of trace time, or ``3000steps``, as steps."""
    m = _DURATION.match(text or "")
    if not m:
        raise TraceError(where, f"{text!r} is not a duration: give e.g. 2m, 90s, 500ms "
                                "or 3000steps")
    value, unit = float(m.group(1)), m.group(2)
    if unit.startswith("step"):
        return int(value)
    return int(value * _UNIT_MS[unit] // step_ms(trace))


def why_serial(trace: Trace) -> str | None:
    """Why this trace replays in one piece (one line), or None if it can split."""
    rq = trace.requests
    if "after" in rq.column_names and rq["after"].null_count < rq.num_rows:
        return ("its requests that arrive after others finish (after:) have no clock "
                "time to split at")
    engine = trace.engine
    if engine.connector and engine.connector not in ("mooncake_store", "offloading"):
        return (f"the state digest does not read its {engine.connector} connector's state "
                "(a MooncakeStore connector's it does)")
    if trace.events is not None and trace.events.num_rows:
        for ev in trace.events.to_pylist():
            # evict, store_remove and store_fault split too: the digest writes
            # what those to come read from before the boundary (digest/events.py).
            if ev["after"] is not None:
                return "its events that run after a request finishes (after:) have no clock time"
    return None


def work_by_step(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Arrival steps (sorted, distinct) and the estimated work of the replay
    before each of them: what a segment costs between two points is the
    difference. Each request costs its decode steps and its prompt tokens,
    counted when it arrives; the engine's steps are counted by clock time."""
    rq = trace.requests
    steps = rq["arrival_step"].to_numpy(zero_copy_only=False).astype(np.int64)
    cost = (rq["output_len"].to_numpy(zero_copy_only=False) * DECODE_COST
            + rq["num_prompt_tokens"].to_numpy(zero_copy_only=False) * PROMPT_TOKEN_COST)
    order = np.argsort(steps, kind="stable")
    steps, cost = steps[order], cost[order]
    points, first = np.unique(steps, return_index=True)
    before = np.concatenate([[0.0], np.cumsum(cost)])[first]
    return points, before + points * STEP_COST


def plan_segments(trace: Trace, k: int, warm_up: int, warm_up_text: str = "") -> SegmentPlan:
    """``k`` segments of about equal work, warm-up included (fewer where the
    trace has fewer distinct arrival steps)."""
    points, work = work_by_step(trace)
    rq = trace.requests
    total = float(work[-1]) + float(
        (rq["output_len"].to_numpy(zero_copy_only=False) * DECODE_COST).max(initial=0)
        + STEP_COST)
    k = max(1, min(k, len(points)))

    def at(step: int) -> float:
        """Work before the first arrival at or after ``step``."""
        i = int(np.searchsorted(points, step, side="left"))
        return float(work[i]) if i < len(points) else total

    def place(target: float) -> list[int] | None:
        starts = [0]
        for _ in range(1, k):
            begin = at(max(0, starts[-1] - warm_up)) if len(starts) > 1 else 0.0
            # The first arrival step where this segment's work reaches the target.
            i = int(np.searchsorted(work, begin + target, side="left"))
            i = max(i, int(np.searchsorted(points, starts[-1], side="right")))
            if i >= len(points):
                return starts           # this segment reaches the end: fewer suffice
            starts.append(int(points[i]))
        begin = at(max(0, starts[-1] - warm_up)) if len(starts) > 1 else 0.0
        return starts if total - begin <= target else None

    lo, hi = total / k, total
    best = [0]
    for _ in range(60):
        mid = (lo + hi) / 2
        found = place(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    starts = sorted(set(best))
    segments = []
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        segments.append(Segment(i, s, end, 0 if i == 0 else max(0, s - warm_up)))
    estimate = tuple((at(s.end) if s.end is not None else total) - at(s.warm_from)
                     for s in segments)
    return SegmentPlan(tuple(segments), warm_up, warm_up_text, k, estimate)
