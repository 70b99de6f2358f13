"""One time segment's replay, in whichever process hosts it.

A :class:`SegmentWorker` builds its engine from its part of the trace (the
arrivals from its warm-up on), replays to its start boundary and takes the
state digest there (:meth:`begin`, answered at once, so the head can check
that boundary while this worker goes on), then replays on to its end
boundary, takes the digest again, and pauses (:meth:`run_on`). The head then
tells it to :meth:`finish` (its successor matched: replay on until its own
arrivals have finished, hand their outcomes back) or to :meth:`extend` into
its successor's time (the successor did not match: this worker's state is the
true one, so it goes on to the next boundary). Time spent paused, waiting for
the head, is no replay's: each call's seconds start when the call does.
"""

from __future__ import annotations

import importlib
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayer.replay.engines.digest.events import Pending
from replayer.replay.engines.digest.walk import DigestError
from replayer.replay.segments.plan import Segment
from traces import Trace
from traces.model.outcome import RequestOutcome

# vLLM release prefix -> the module whose ``DIGEST`` reads that release's state.
DIGESTS = {"0.33": "replayer.replay.engines.digest.release_0_33",
           "0.34": "replayer.replay.engines.digest.release_0_34",
           **dict.fromkeys(("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32"),
                           "replayer.replay.engines.digest.release_0_29")}


def digest_module(version: str) -> str | None:
    from replayer.replay.engines import release_prefix

    prefix = release_prefix(version, DIGESTS)
    return None if prefix is None else DIGESTS[prefix]


def serial_reason(trace: Trace, spec: Any, store: Any = None) -> str | None:
    """Why ``trace`` on engine ``spec`` (and ``store``, a StoreSpec: None is the
    memory store) replays in one piece (one line), or None."""
    from replayer.replay.engines.sources.specs import resolve
    from replayer.replay.segments.plan import why_serial

    engine = resolve(spec)
    if engine.info.worker == "model":
        return "the state digest does not read a model runner's state"
    if digest_module(engine.info.vllm) is None:
        return f"there is no state digest for vLLM {engine.info.vllm} (segments need one)"
    if trace.engine.connector and store is not None and store.kind != "memory":
        return (f"its store is {store.label()}, whose contents the state digest cannot read "
                "(the memory store's it does)")
    return why_serial(trace)


@dataclass(frozen=True)
class Boundary:
    """Where one worker stood at a boundary: its own counts and its state's digest."""

    point: int                     # the boundary (an arrival step)
    clock: int                     # the clock when the loop reached it
    steps: int                     # engine steps this worker had run
    lookups: int                   # prefix lookups this worker's engine had made
    digest: dict[str, str] | None  # None: the state held a value the digest cannot encode
    seconds: float                 # replay seconds since the previous pause
    unreadable: str | None = None  # then, what it was (the boundary is not trusted)
    # How far the naming logs and the rows they name had come (a store or
    # KV-event trace; segments/rows.py).
    marks: dict[str, int] | None = None


@dataclass
class SegmentOutcome:
    """What a worker hands back for the arrivals it owns."""

    requests: list[RequestOutcome]
    finished_engine_step: dict[str, int]       # own step counts
    lookups: dict[str, tuple[int, int]] | None  # own (step, lookup number)
    steps: int | None                          # own steps at the end (the last owner)
    engine: Any
    kv_groups: Any
    hit_alignment: int | None
    hits_are_first_prefill: bool | None
    notes: list[str]
    seconds: float                             # replay seconds of the finish
    timings: dict[str, float] = field(default_factory=dict)
    # The whole replay's store report and KV-event rows, with their naming logs
    # (a store or KV-event trace): the head takes the part this worker owned
    # (segments/rows.py).
    store: dict[str, Any] | None = None
    kv_events: dict[str, Any] | None = None


def trace_part(trace: Trace, segment: Segment, sized: Any) -> Trace:
    """The arrivals from ``segment``'s warm-up on, under the whole trace's sized
    engine (a part must not size its engine by its own longest request).
    Events before the warm-up, and those naming a request outside the part,
    are left out; goldens and recorded outcomes do not travel (whether KV-cache
    events are collected does)."""
    rq = trace.requests
    part = rq.filter(pc.greater_equal(rq["arrival_step"], segment.warm_from)) \
        if segment.warm_from > 0 else rq
    ids = set(part["id"].to_pylist()) if segment.warm_from > 0 else None
    events = trace.events
    if events is not None and segment.warm_from > 0:
        keep = [(e["at_step"] is not None and e["at_step"] >= segment.warm_from)
                and (e.get("target") is None or e["target"] in ids)
                for e in events.to_pylist()]
        events = events.filter(pa.array(keep)) if any(keep) else None
    steps = trace.steps
    if steps is not None and ids is not None:
        steps = steps.filter(pc.is_in(steps["id"], pa.array(sorted(ids), pa.string())))
    return Trace(header={**trace.header, "engine": sized}, requests=part, events=events,
                 steps=steps, path=trace.path, kv_events_wanted=trace.collects_kv_events)


def _named_parts(result: Any, logs: dict[str, Any]) -> dict[str, Any]:
    """The store report and KV-event rows of a replay, each with its naming log."""
    out: dict[str, Any] = {}
    if result.store is not None:
        out["store"] = {**result.store, "names": list(logs["store_names"])}
    if result.kv_events is not None:
        out["kv_events"] = {"rows": result.kv_events, "names": list(logs["kv_names"]),
                            "row_names": list(logs["kv_row_names"])}
    return out


class SegmentWorker:
    """One segment's engine and paused replay (built on :meth:`begin`)."""

    def __init__(self, segment: Segment, trace: Trace, spec: Any = "installed",
                 shortcuts: bool = True, store: Any = None) -> None:
        self.segment = segment
        self.trace = trace
        self.spec = spec
        self.store = store              # a StoreSpec (--store memory, its capacity) or None
        self.shortcuts = shortcuts
        steps = trace.requests["arrival_step"].to_numpy(zero_copy_only=False)
        self._sorted_steps = np.sort(steps.astype(np.int64), kind="stable")
        self._stack = ExitStack()
        self._run: Any = None
        self._engine: Any = None
        self._digest: Callable[..., dict[str, str]] | None = None
        self._counters: Callable[[Any], dict[str, int]] | None = None
        self.owned_end = segment.end
        # The part's events, for the digest's list of those still to come.
        self._events = trace.events.to_pylist() if trace.events is not None else []
        self._rows: Any = None
        self._row_of: dict[str, int] = {}
        self._tokens: Any = None
        self._clock = time.perf_counter()
        self.timings: dict[str, float] = {}

    def _arrivals_before(self, point: int | None) -> int:
        if point is None:
            return len(self._sorted_steps)
        return int(np.searchsorted(self._sorted_steps, point, side="left"))

    def _lap(self) -> float:
        now = time.perf_counter()
        spent, self._clock = now - self._clock, now
        return spent

    def _pending(self, clock: int) -> Pending:
        """The part's events not yet run at a pause at ``clock`` (the loop pauses
        before the events due then): an ``evict``, ``store_remove`` or
        ``store_fault`` among them reads state from before the boundary; and
        the part's requests, as the loop would add them."""
        return Pending([e for e in self._events
                        if e["at_step"] is not None and e["at_step"] >= clock],
                       self._request_of)

    def _request_of(self, rid: str) -> Any:
        """Request ``rid`` of this part as the loop adds it (None: not in the part)."""
        from replayer.replay.loop import engine_request
        from traces.materialize import TokenSource, request_rows

        if self._rows is None:
            self._rows = request_rows(self.trace.requests)
            self._row_of = {r: i for i, r in enumerate(self._rows.ids)}
            self._tokens = TokenSource(self.trace.header, self.trace.requests,
                                       self.trace.request_lists)
        i = self._row_of.get(rid)
        if i is None:
            return None
        return engine_request(self._rows, self._tokens, i,
                              self.trace.engine.num_speculative_tokens, shortcuts=False)

    def _boundary(self, point: int) -> Boundary:
        run = self._run
        loop = {"clock": run.clock, "idle": run.idle, "since_progress": run.since_progress}
        seconds = self._lap()
        try:
            digest, unreadable = self._digest(self._engine, loop, self._pending(run.clock)), None
        except DigestError as exc:
            digest, unreadable = None, str(exc)
        except (AttributeError, ImportError) as exc:   # what this release lacks: never trusted
            digest, unreadable = None, f"a field the digest reads is not there ({exc})"
        except Exception as exc:  # noqa: BLE001 - a digest that fails proves nothing
            digest, unreadable = None, f"the digest failed ({type(exc).__name__}: {exc})"
        counted = self._counters(self._engine)
        marks = self._engine.segment_marks()
        self._lap()                           # the digest's own time is not the replay's
        return Boundary(point, run.clock, run.steps_run, counted["lookups"], digest, seconds,
                        unreadable, marks)

    def begin(self) -> dict[str, Any]:
        """Build the engine and replay to the start boundary: its digest (None
        for the first segment, which starts where the sequential replay does)."""
        from replayer.replay.engines import EngineError
        from replayer.replay.execution.in_process import engine_here
        from replayer.replay.loop import ReplayRun

        t0 = time.perf_counter()
        self._engine = self._stack.enter_context(engine_here(self.trace, self.spec,
                                                             store=self.store))
        module = digest_module(self._engine.info.vllm)
        if module is None:
            raise EngineError(f"{self._engine.info.label}: no state digest for this release "
                              "(segments need one)")
        mod = importlib.import_module(module)
        self._digest, self._counters = mod.DIGEST, mod.counters
        self.timings["startup_s"] = time.perf_counter() - t0
        # Store keys and KV-event blocks are named by the head from every
        # segment's namings (segments/rows.py).
        self._engine.start_name_log()
        self._lap()
        self._run = ReplayRun(self.trace, self._engine, shortcuts=self.shortcuts)
        seg = self.segment
        start = None
        if not seg.first:
            if not self._run.run_to(seg.start):
                raise RuntimeError(f"segment {seg.index} ended before its start "
                                   f"boundary {seg.start}")
            start = self._boundary(seg.start)
        return {"start": start, "timings": dict(self.timings)}

    def run_on(self) -> dict[str, Any]:
        """From the start boundary on to the end boundary (its digest) and pause;
        the last segment replays to the end of the trace."""
        self._lap()
        return self._to(self.segment.end)

    def _to(self, end: int | None) -> dict[str, Any]:
        if end is None:
            self._run.stop_after(None)
            self._run.run_to(None)
            return {"end": None, "ended": True, "seconds": self._lap()}
        if not self._run.run_to(end):
            raise RuntimeError(f"segment {self.segment.index} ended before boundary {end}")
        return {"end": self._boundary(end), "ended": False}

    def extend(self, end: int | None) -> dict[str, Any]:
        """Own the next segment's arrivals too: replay on to ``end`` (None: the end)."""
        self._lap()
        self.owned_end = end
        return self._to(end)

    def finish(self) -> SegmentOutcome:
        """Replay on until every owned arrival has finished; their outcomes."""
        self._lap()
        run = self._run
        run.stop_after(None if self.owned_end is None else self._arrivals_before(self.owned_end))
        run.run_to(None)
        seconds = self._lap()
        result = run.result()
        first = 0 if self.segment.first else self._arrivals_before(self.segment.start)
        last = self._arrivals_before(self.owned_end)
        mine = result.requests[first:last]
        ids = {r.id for r in mine}
        fes = {rid: s for rid, s in result.finished_engine_step.items() if rid in ids}
        lookups = None if result.lookups is None else {
            rid: v for rid, v in result.lookups.items() if rid in ids}
        out = SegmentOutcome(
            requests=mine, finished_engine_step=fes, lookups=lookups,
            steps=result.steps if self.owned_end is None else None,
            engine=result.engine, kv_groups=result.kv_groups,
            hit_alignment=result.hit_alignment,
            hits_are_first_prefill=result.hits_are_first_prefill, notes=list(result.notes),
            seconds=seconds, timings={**self.timings, **result.timings},
            **_named_parts(result, self._engine.segment_logs()))
        self.close()
        return out

    def close(self) -> None:
        self._run = None
        self._engine = None
        self._stack.close()

