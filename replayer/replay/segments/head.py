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


def replay_segments(trace: Trace, host: Any, segments: int, warm_up: int,
                    warm_up_text: str = "", spec: Any = "installed", shortcuts: bool = True,
                    say: Callable[[str], None] | None = None) -> tuple[ReplayResult, SegmentReport]:
    """Replay ``trace`` in ``segments`` time segments on ``host``: the sequential
    replay's result, and what happened at each boundary."""
    t0 = time.perf_counter()
    # The host's start-up, charged to its first replay (explain and sweep run several).
    host_s, host.startup_s = getattr(host, "startup_s", 0.0), 0.0
    plan = plan_segments(trace, segments, warm_up, warm_up_text)
    report = SegmentReport(plan, host.describe(), host_s=host_s)
    sized = trace.sized_engine()
    run = next(_REPLAYS)
    segs = plan.segments
    # Each segment's start digest is answered as soon as its warm-up ends (the
    # boundary is checked then, and the segment before finishes its tail at once),
    # while the segment replays on to its end boundary.
    starts: dict[int, Any] = {}
    ends: dict[int, Any] = {}
    for seg in segs:
        key = (run, seg.index)
        host.call(seg.index, key, "open", seg, trace_part(trace, seg, sized), spec, shortcuts)
        starts[seg.index] = host.call(seg.index, key, "begin")
        ends[seg.index] = host.call(seg.index, key, "run_on")
    open_keys = {seg.index for seg in segs}

    def call(index: int, method: str, *args: Any):
        return host.call(index, (run, index), method, *args)

    def own_seconds(state: dict) -> float:
        """A run_on's or extend's replay seconds, to its end boundary or the end."""
        return state["seconds"] if state["ended"] else state["end"].seconds

    def timed(index: int, started: dict, state: dict) -> None:
        start = started["start"]
        report.times[index] = [started["timings"]["startup_s"],
                               0.0 if start is None else start.seconds, own_seconds(state), 0.0]

    try:
        first = starts[0].result()
        state = ends[0].result()
        timed(0, first, state)
        owner = _Owner(0, 0, 0, 0, 0)
        owners = [owner]
        sequential = first["timings"]["startup_s"]
        b = 1
        while True:
            sequential += own_seconds(state)
            if state["ended"]:
                break
            end: Boundary = state["end"]
            nxt = segs[b]
            try:
                started = starts[b].result()
                start: Boundary | None = started["start"]
                note = None
            except Exception as exc:  # noqa: BLE001 - a segment that fails is replayed again
                started, start, note = None, None, f"failed: {exc}"
            matched = start is not None and start.digest["total"] == end.digest["total"]
            report.checks.append(BoundaryCheck(nxt.index, nxt.start, end.digest,
                                               None if start is None else start.digest,
                                               matched, note))
            if matched:
                owner.finished = call(owner.index, "finish")
                open_keys.discard(owner.index)
                owner = _Owner(nxt.index, start.steps, start.lookups,
                               owner.steps + end.steps - owner.own_steps,
                               owner.lookups + end.lookups - owner.own_lookups)
                owners.append(owner)
                state = ends[b].result()
                timed(b, started, state)
            else:
                if started is not None:
                    call(nxt.index, "close")
                open_keys.discard(nxt.index)
                if say is not None:
                    say(f"segment {nxt.index}'s start did not match at step {nxt.start}: "
                        f"segment {owner.index} replays on into it")
                state = call(owner.index, "extend", nxt.end).result()
                report.times[owner.index][2] += own_seconds(state)
            b += 1
        owner.finished = call(owner.index, "finish")
        open_keys.discard(owner.index)
        outcomes: list[tuple[_Owner, SegmentOutcome]] = [(o, o.finished.result()) for o in owners]
        for o, out in outcomes:
            report.times[o.index][3] = out.seconds
    finally:
        for index in open_keys:
            try:
                call(index, "close").result()
            except Exception:  # noqa: BLE001 - closing what is left; the error above counts
                pass
    report.wall_s = time.perf_counter() - t0 + host_s
    # Where the host imported vLLM once for every segment, a sequential replay pays that too.
    report.sequential_s = sequential + (host_s if getattr(host, "imports_vllm_once", False)
                                        else 0.0)
    return assemble(outcomes), report


def assemble(parts: list[tuple[_Owner, SegmentOutcome]]) -> ReplayResult:
    """The sequential replay's result from its owners' parts, in arrival order."""
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
            if note not in notes:
                notes.append(note)
        if out.steps is not None:
            steps = out.steps + shift
    head = parts[0][1]
    return ReplayResult(engine=head.engine, requests=requests, steps=steps,
                        kv_groups=head.kv_groups, notes=notes, hit_alignment=head.hit_alignment,
                        lookups=lookups, finished_engine_step=finished,
                        hits_are_first_prefill=head.hits_are_first_prefill,
                        timings={"loop_s": sum(out.seconds for _, out in parts)})
