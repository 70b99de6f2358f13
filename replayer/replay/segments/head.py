"""The head of a segmented replay: starts every segment, proves each boundary, assembles.

Every segment replays at once on the host's slots. Boundary by boundary, in
order, the head compares the digest the exact path reached there (segment 0's
end, or whichever worker's state is the true one by then) with the digest the
next segment started from. Equal: the next segment's state is the true one,
its outcomes count, and the previous worker finishes its own arrivals.
Different: that segment is dropped and the previous worker replays on into
its time (it holds the true state), up to the next boundary, where the same
comparison follows. The result is therefore the sequential replay's, byte for
byte, whatever the warm-up; a short warm-up only costs speed.

Counts that run from an engine's start (engine steps, prefix lookups) are
carried across a boundary by offset: what the exact path had counted at the
boundary, plus what the next worker counted after it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from replayer.replay.loop import ReplayResult
from replayer.replay.segments.plan import SegmentPlan, plan_segments
from replayer.replay.segments.worker import Boundary, SegmentOutcome, trace_part
from traces import Trace

_REPLAYS = itertools.count()


@dataclass
class BoundaryCheck:
    """One boundary: the exact path's digest there, the next segment's, the verdict."""

    index: int                 # the segment that starts here
    point: int                 # its start (an arrival step)
    exact: dict[str, str]
    started: dict[str, str] | None     # None: that segment failed before reaching it
    matched: bool
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"segment": self.index, "step": self.point,
                               "matched": self.matched, "exact": self.exact,
                               "segment_started": self.started}
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class SegmentReport:
    """What the user is told about a segmented replay (stderr; digests in --json)."""

    plan: SegmentPlan
    where: str
    checks: list[BoundaryCheck] = field(default_factory=list)
    wall_s: float = 0.0
    sequential_s: float = 0.0         # the exact path's own replay time, start-up once
    host_s: float = 0.0               # starting the host's processes (in wall_s)
    # Per segment whose outcomes count: start-up, warm-up, own-range (extensions
    # into a dropped successor's range included) and finishing seconds (after its
    # end boundary, until every arrival it owns has finished: the plan does not
    # see this tail, so it shows here where a split came out uneven).
    times: dict[int, list[float]] = field(default_factory=dict)

    @property
    def matched(self) -> list[int]:
        return [c.index for c in self.checks if c.matched]

    @property
    def replayed(self) -> list[int]:
        return [c.index for c in self.checks if not c.matched]

    def lines(self) -> list[str]:
        p = self.plan
        n = len(p.segments)
        fewer = f" (of {p.asked} asked: the trace has fewer arrival steps)" if n < p.asked else ""
        out = [f"{n} segments{fewer} at steps {', '.join(map(str, p.boundaries)) or '-'}, "
               f"warm-up {p.warm_up_text or p.warm_up_steps} ({p.warm_up_steps} steps), "
               f"{self.where}"]
        if self.checks:
            again = ", ".join(f"segment {c.index} (step {c.point})" for c in self.checks
                              if not c.matched) or "none"
            out.append(f"boundaries matched: {len(self.matched)} of {len(self.checks)}; "
                       f"replayed again from the segment before: {again}")
        speed = self.sequential_s / self.wall_s if self.wall_s else 0.0
        host = f" ({self.host_s:.1f} s of it starting the workers)" if self.host_s else ""
        out.append(f"{self.wall_s:.1f} s wall{host}; the exact path's own replay time "
                   f"{self.sequential_s:.1f} s: about {speed:.1f}x a sequential replay")
        if self.times:
            out.append("seconds per segment (start-up + warm-up + own range + finishing): "
                       + ", ".join(f"{k}: {a:.1f}+{b:.1f}+{c:.1f}+{d:.1f}"
                                   for k, (a, b, c, d) in sorted(self.times.items())))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"segments": [{"index": s.index, "start": s.start, "end": s.end,
                              "warm_from": s.warm_from} for s in self.plan.segments],
                "warm_up_steps": self.plan.warm_up_steps,
                "boundaries": [c.as_dict() for c in self.checks]}


@dataclass
class _Owner:
    """A worker whose outcomes count, from its start boundary on."""

    index: int
    own_steps: int             # its own counts at its start boundary
    own_lookups: int
    steps: int                 # the exact path's counts there
    lookups: int
    finished: Any = None       # the future of its finish()
    # Where its part of the naming logs and rows begins and ends (segments/rows.py):
    # None at the start for the first owner, at the end for the last.
    start_marks: dict[str, int] | None = None
    end_marks: dict[str, int] | None = None


def replay_segments(trace: Trace, host: Any, segments: int, warm_up: int,
                    warm_up_text: str = "", spec: Any = "installed", shortcuts: bool = True,
                    say: Callable[[str], None] | None = None,
                    store: Any = None) -> tuple[ReplayResult, SegmentReport]:
    """Replay ``trace`` in ``segments`` time segments on ``host``: the sequential
    replay's result, and what happened at each boundary. ``store``: the memory
    store's StoreSpec (its capacity) for a MooncakeStore trace, None: the default."""
    t0 = time.perf_counter()
    # The host's start-up, charged to its first replay (explain and sweep run several).
    host_s, host.startup_s = getattr(host, "startup_s", 0.0), 0.0
    plan = plan_segments(trace, segments, warm_up, warm_up_text)
    report = SegmentReport(plan, host.describe(), host_s=host_s)
    proof = _Proof(host, plan.segments, report, say)
    proof.start(trace, trace.sized_engine(), spec, shortcuts, store)
    try:
        sequential = proof.prove_boundaries()
        outcomes = proof.finish()
    finally:
        proof.close_the_rest()
    report.wall_s = time.perf_counter() - t0 + host_s
    # Where the host imported vLLM once for every segment, a sequential replay pays that too.
    report.sequential_s = sequential + (host_s if getattr(host, "imports_vllm_once", False)
                                        else 0.0)
    return assemble(outcomes), report


def _own_seconds(state: dict) -> float:
    """A run_on's or extend's replay seconds, to its end boundary or the end."""
    return state["seconds"] if state["ended"] else state["end"].seconds


class _Proof:
    """One segmented replay's walk over its boundaries, in order, on ``host``."""

    def __init__(self, host: Any, segs: list[Any], report: SegmentReport,
                 say: Callable[[str], None] | None) -> None:
        self.host = host
        self.run = next(_REPLAYS)
        self.segs = segs
        self.report = report
        self.say = say
        self.starts: dict[int, Any] = {}
        self.ends: dict[int, Any] = {}
        self.open: set[int] = set()
        self.owners: list[_Owner] = []
        self._said: set[str] = set()

    def call(self, index: int, method: str, *args: Any):
        return self.host.call(index, (self.run, index), method, *args)

    def start(self, trace: Trace, sized: Any, spec: Any, shortcuts: bool, store: Any) -> None:
        """Every segment at once. Each one's start digest is answered as soon as its
        warm-up ends (the boundary is checked then, and the segment before finishes
        its tail at once), while the segment replays on to its end boundary."""
        for seg in self.segs:
            self.call(seg.index, "open", seg, trace_part(trace, seg, sized), spec, shortcuts,
                      store)
            self.starts[seg.index] = self.call(seg.index, "begin")
            self.ends[seg.index] = self.call(seg.index, "run_on")
            self.open.add(seg.index)

    def _timed(self, index: int, started: dict, state: dict) -> None:
        start = started["start"]
        self.report.times[index] = [started["timings"]["startup_s"],
                                    0.0 if start is None else start.seconds,
                                    _own_seconds(state), 0.0]

    def prove_boundaries(self) -> float:
        """Each boundary in order: the next segment's outcomes count, or the worker
        holding the true state replays on into its range. The exact path's own
        replay seconds, one start-up included."""
        first = self.starts[0].result()
        state = self.ends[0].result()
        self._timed(0, first, state)
        owner = _Owner(0, 0, 0, 0, 0)
        self.owners.append(owner)
        sequential = first["timings"]["startup_s"]
        b = 1
        while True:
            sequential += _own_seconds(state)
            if state["ended"]:
                return sequential
            end: Boundary = state["end"]
            check, started, start = self._check(b, end)
            if check.matched:
                owner, state = self._hand_over(owner, b, end, started, start)
            else:
                state = self._replay_on(owner, check, started)
            b += 1

    def _check(self, b: int, end: Boundary) -> tuple[BoundaryCheck, Any, Boundary | None]:
        """Boundary ``b``: the exact path's digest there against segment ``b``'s start."""
        nxt = self.segs[b]
        try:
            started = self.starts[b].result()
            start: Boundary | None = started["start"]
            note = None
        except Exception as exc:  # noqa: BLE001 - a segment that fails is replayed again
            started, start, note = None, None, f"failed: {exc}"
        unreadable = end.unreadable or (start.unreadable if start is not None else None)
        if unreadable:
            note = f"the state digest cannot be taken: {unreadable}"
        matched = (start is not None and start.digest is not None and end.digest is not None
                   and start.digest["total"] == end.digest["total"])
        check = BoundaryCheck(nxt.index, nxt.start, end.digest,
                              None if start is None else start.digest, matched, note)
        self.report.checks.append(check)
        if unreadable and self.say is not None and unreadable not in self._said:
            self._said.add(unreadable)
            self.say(f"the state digest cannot be taken ({unreadable}): a boundary where "
                     "it cannot is never trusted")
        return check, started, start

    def _hand_over(self, owner: _Owner, b: int, end: Boundary, started: dict,
                   start: Boundary) -> tuple[_Owner, dict]:
        """A matched boundary: the owner finishes its arrivals, segment ``b`` owns on."""
        owner.finished = self.call(owner.index, "finish")
        owner.end_marks = end.marks
        self.open.discard(owner.index)
        nxt = _Owner(b, start.steps, start.lookups,
                     owner.steps + end.steps - owner.own_steps,
                     owner.lookups + end.lookups - owner.own_lookups,
                     start_marks=start.marks)
        self.owners.append(nxt)
        state = self.ends[b].result()
        self._timed(b, started, state)
        return nxt, state

    def _replay_on(self, owner: _Owner, check: BoundaryCheck, started: dict | None) -> dict:
        """A boundary not proven: its segment is dropped, the owner replays on into it."""
        nxt = self.segs[check.index]
        if started is not None:
            self.call(nxt.index, "close")
        self.open.discard(nxt.index)
        if self.say is not None:
            self.say(f"segment {nxt.index}'s start did not match at step {nxt.start}: "
                     f"segment {owner.index} replays on into it")
        state = self.call(owner.index, "extend", nxt.end).result()
        self.report.times[owner.index][2] += _own_seconds(state)
        return state

    def finish(self) -> list[tuple[_Owner, SegmentOutcome]]:
        """The last owner finishes; every owner's outcomes, in order."""
        last = self.owners[-1]
        last.finished = self.call(last.index, "finish")
        self.open.discard(last.index)
        outcomes = [(o, o.finished.result()) for o in self.owners]
        for o, out in outcomes:
            self.report.times[o.index][3] = out.seconds
        return outcomes

    def close_the_rest(self) -> None:
        for index in self.open:
            try:
                self.call(index, "close").result()
            except Exception:  # noqa: BLE001 - closing what is left; the error above counts
                pass


def assemble(parts: list[tuple[_Owner, SegmentOutcome]]) -> ReplayResult:
    """The sequential replay's result from its owners' parts, in arrival order."""
    from replayer.replay.segments.rows import assemble_kv_events, assemble_store

    store, store_notes = assemble_store(parts)
    requests = []
    finished: dict[str, int] = {}
    lookups: dict[str, tuple[int, int]] | None = {}
    notes: list[str] = []
    steps = 0
    for o, out in parts:
        shift = o.steps - o.own_steps
        shift_lookups = o.lookups - o.own_lookups
        requests.extend(out.requests)
        for rid, s in out.finished_engine_step.items():
            finished[rid] = s + shift
        if out.lookups is None or lookups is None:
            lookups = None
        else:
            for rid, (s, n) in out.lookups.items():
                lookups[rid] = (s + shift, n + shift_lookups)
        for note in out.notes:
            if note not in notes and note not in store_notes:
                notes.append(note)
        if out.steps is not None:
            steps = out.steps + shift
    if store is not None:
        notes += [n for n in store["notes"] if n not in notes]
    head = parts[0][1]
    return ReplayResult(engine=head.engine, requests=requests, steps=steps, store=store,
                        kv_events=assemble_kv_events(parts),
                        kv_groups=head.kv_groups, notes=notes, hit_alignment=head.hit_alignment,
                        lookups=lookups, finished_engine_step=finished,
                        hits_are_first_prefill=head.hits_are_first_prefill,
                        timings={"loop_s": sum(out.seconds for _, out in parts)})
