"""The step clock's agenda: when each request arrives and each event runs.

The rules (docs/scenarios.md, "The step clock"): a request with ``arrival_step`` k enters
before step k; one with ``after: X`` enters as soon as X has finished, before
the next step; an event ``after: X`` runs right when X finishes, before any
request that arrives after X; an event ``at_step: k`` runs before step k, and
before the requests that arrive then. Within one point of the clock, things
happen in trace row order. The replay loop asks this object what is due; it
knows nothing of engines, so the rules are tested without vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

# Past every step (an arrival_step has no upper bound): no timed arrival is left.
NO_MORE = float("inf")
# A store key by meaning: (first request, group, boundary, rank); None matches any.
KeySelector = tuple[str, Optional[int], Optional[int], Optional[int]]


@dataclass(frozen=True)
class Event:
    """One row of the events table, with the reason it runs now (for messages)."""

    action: str
    target: str | None
    why: str
    group: int | None = None          # evict: a KV-cache group
    keys: tuple[KeySelector, ...] = ()   # store_remove, store_fault: keys by meaning
    op: str | None = None             # store_fault: the op that fails, its code, how often
    code: int | None = None
    times: int | None = None

    @classmethod
    def of(cls, row: dict[str, Any], why: str) -> "Event":
        keys = tuple((k["request"], k.get("group"), k.get("boundary"), k.get("rank"))
                     for k in row.get("keys") or ())
        return cls(row["action"], row.get("target"), why, row.get("group"), keys,
                   row.get("op"), row.get("code"), row.get("times"))


class Schedule:
    """Arrivals (request rows) and events of one trace, handed out as they fall due."""

    def __init__(self, arrival_step: Sequence[int | None], after: Sequence[str | None],
                 events: Sequence[dict[str, Any]] = ()) -> None:
        n = len(arrival_step)
        # Timed rows in (step, row) order, as two arrays: a day of traffic stays small.
        steps = np.fromiter((s or 0 for s in arrival_step), np.int64, n)
        timed = np.fromiter((a is None for a in after), bool, n)
        self._after_rows: dict[str, list[int]] = defaultdict(list)
        if not timed.all():
            for i, a in enumerate(after):
                if a is not None:
                    self._after_rows[a].append(i)
        rows = np.flatnonzero(timed)
        self._timed_rows = rows[np.argsort(steps[rows], kind="stable")]
        self._timed_steps = steps[self._timed_rows]
        self._after_events: dict[str, list[Event]] = defaultdict(list)
        steps: list[tuple[int, int, Event]] = []
        for j, ev in enumerate(events):
            if ev["after"] is not None:
                self._after_events[ev["after"]].append(Event.of(ev, f"after {ev['after']}"))
            else:
                steps.append((ev["at_step"], j, Event.of(ev, f"at_step {ev['at_step']}")))
        steps.sort(key=lambda e: (e[0], e[1]))
        self._step_events = [(k, ev) for k, _, ev in steps]
        self._next_row = 0
        self._next_event = 0
        # The step of the next timed arrival as a Python int (NO_MORE: none left):
        # the loop asks every step, and a numpy scalar comparison costs ~1 us.
        self._next_arrival = int(self._timed_steps[0]) if len(self._timed_steps) else NO_MORE

    def events_due(self, clock: int) -> list[Event]:
        """``at_step`` events whose step has come (run these first)."""
        out = []
        while (self._next_event < len(self._step_events)
               and self._step_events[self._next_event][0] <= clock):
            out.append(self._step_events[self._next_event][1])
            self._next_event += 1
        return out

    def arrivals_due(self, clock: int) -> list[int]:
        """Rows of requests with an ``arrival_step`` that has come, in (step, row) order."""
        if self._next_arrival > clock:
            return []
        start = self._next_row
        end = int(np.searchsorted(self._timed_steps, clock, side="right"))
        self._next_row = end
        self._next_arrival = (int(self._timed_steps[end]) if end < len(self._timed_steps)
                              else NO_MORE)
        return self._timed_rows[start:end].tolist()

    def after(self, request_id: str) -> tuple[list[Event], list[int]]:
        """What ``request_id`` finishing sets off: its events, then its followers' rows."""
        return self._after_events.get(request_id, []), self._after_rows.get(request_id, [])

    def next_point(self) -> int | None:
        """The next step anything is scheduled for (the idle clock jumps there), or None."""
        points = []
        if self._next_row < len(self._timed_steps):
            points.append(int(self._timed_steps[self._next_row]))
        if self._next_event < len(self._step_events):
            points.append(self._step_events[self._next_event][0])
        return min(points) if points else None
