"""The replay loop: feeds a trace's arrivals and events to an engine, step by step.

:func:`replay` is a pure loop over an engine it is handed: it never builds,
chooses or closes one (:mod:`replayer.replay.execution` does), and it knows nothing of
which vLLM runs. When things happen is :class:`replayer.replay.schedule.Schedule`'s
business (the step-clock rules); the clock is the number of engine steps run
so far, and when the engine has nothing to do it jumps to the next point
anything is scheduled for, so idle time costs nothing.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from replayer.replay.engines.base import EngineAdapter, EngineInfo, EngineRequest
from replayer.replay.gc_tuning import fewer_gc_passes
from replayer.replay.schedule import Event, Schedule
from traces import Trace
from traces.materialize import TokenSource, request_rows
from traces.model.outcome import RequestOutcome

# A step in which nothing could be scheduled, this many times running, means the
# trace can never finish (a prompt that does not fit the KV cache, say).
MAX_IDLE_STEPS = 1000
# Steps that compute tokens yet finish nothing: preemption undoes prefills, and
# requests that keep preempting each other in a cache too small for them all
# never finish (vLLM itself would spin the same way). Without preemption no
# request needs more steps than it has tokens, so past twice the live requests'
# tokens (and at least this many steps) the replay stops with an error.
MIN_STUCK_STEPS = 10_000
# A pause or stop that never comes.
NEVER = 1 << 62


class ReplayError(RuntimeError):
    """The replay cannot go on; the message names the step and the cause."""


@dataclass
class Progress:
    done: int
    total: int
    steps: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class ReplayResult:
    engine: EngineInfo
    requests: list[RequestOutcome]          # in arrival order
    steps: int
    # Store operations and lookups when the trace has a connector (see store_json).
    store: dict[str, Any] | None = None
    # vLLM's KV-cache events, one kv_events row per block, when the trace asked
    # for them (replayer.replay.kv_events); their summary is in the JSON.
    kv_events: list[dict[str, Any]] | None = None
    # vLLM's KV-cache groups in its own order (kind, EAGLE drop), when the adapter tells.
    kv_groups: list[dict[str, Any]] | None = None
    # Tokens every prefix hit is a multiple of (vLLM's cache_hit_alignment_tokens),
    # when the adapter tells; not part of the JSON.
    hit_alignment: int | None = None
    # The fewest num_gpu_blocks vLLM builds this engine with (one max_model_len
    # request in every group, plus the null block), when the adapter tells; the
    # floor of shrink's cache search. Not part of the JSON.
    min_gpu_blocks: int | None = None
    # When each request last looked up the prefix cache, (engine step, lookup
    # number), and the engine step it finished in (steps counted as run, not
    # the clock): who could see whose prefix (replayer.analysis.explain). Adapters that
    # tell; not part of the JSON.
    lookups: dict[str, tuple[int, int]] | None = None
    finished_engine_step: dict[str, int] = field(default_factory=dict)
    # Whether the engine reports a request's first scheduled prefill, so that a
    # preemption never changes a hit (None: the adapter does not say); explain's
    # preemption evidence.
    hits_are_first_prefill: bool | None = None
    # Settings of the trace this engine does not have, and how it replayed
    # without them (older releases); said on stderr, never part of the JSON.
    notes: list[str] = field(default_factory=list)
    # Timings: never part of the deterministic output.
    timings: dict[str, float] = field(default_factory=dict)
    # When the outcomes went to a sink instead of ``requests``: their totals
    # (requests, prompt_tokens, cached_tokens), which the summary then reads.
    streamed: dict[str, int] | None = None

    def by_id(self) -> dict[str, RequestOutcome]:
        return {r.id: r for r in self.requests}

    def summary(self) -> dict[str, Any]:
        if self.streamed is not None:
            count, prompt, cached = (self.streamed[k] for k in
                                     ("requests", "prompt_tokens", "cached_tokens"))
        else:
            count = len(self.requests)
            prompt = sum(r.num_prompt_tokens for r in self.requests)
            cached = sum(r.num_cached_tokens or 0 for r in self.requests)
        return {"requests": count, "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
                "steps": self.steps}

    def as_dict(self) -> dict[str, Any]:
        out = {"engine": self.engine.as_dict(), "requests": [r.as_dict() for r in self.requests],
               "summary": self.summary()}
        if self.kv_groups is not None:
            out["kv_groups"] = self.kv_groups
        if self.store is not None:
            out["store"] = store_json(self.store)
        if self.kv_events is not None:
            out["kv_events"] = kv_events_json(self.kv_events)
        return out


def kv_events_json(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The KV-event part of ``--json``: blocks per event kind, and per first request
    and group the boundaries stored, skipped (not kept) and removed, as the
    event goldens hold them (traces.goldens.events)."""
    from traces.goldens.events import SECTIONS, from_rows

    summary = from_rows(rows)
    counts: dict[str, int] = {}
    for r in rows:
        name = r["event"] + (" (not kept)" if r["kept"] is False else "")
        counts[name] = counts.get(name, 0) + 1
    out: dict[str, Any] = {"blocks": dict(sorted(counts.items()))}
    for section in SECTIONS:
        out[section] = {rid: {str(g): bs for g, bs in groups.items()}
                        for rid, groups in summary[section].items()}
    out["cleared"] = summary["cleared"]
    return out


def store_json(report: dict[str, Any]) -> dict[str, Any]:
    """The store part of ``--json``: keys put in order, lookup hit lengths."""
    rows = report["rows"]
    return {"backend": report["backend"],
            "puts": [r["key"] for r in rows if r["op"] == "put" and r["result"] >= 0],
            "lookups": [{"request": x["request"], "num_tokens": x["num_tokens"],
                         "hit_length": x["hit_length"]} for x in report["lookups"]],
            "ops": {op: sum(1 for r in rows if r["op"] == op)
                    for op in sorted({r["op"] for r in rows})}}


def recorded_accepted(trace: Trace) -> dict[tuple[str, int], int]:
    """(request, i) -> drafts accepted at the request's i-th verification (its i-th
    step with drafts scheduled) in the recording's steps table, where known.

    Replay holds the null model to these, so a recording where drafts were
    rejected replays the same schedule (the null model would accept all).
    Counted per request, not by step number: a live request that waited a step
    longer for an asynchronous store load verifies the same drafts later."""
    steps = trace.steps
    if steps is None or "num_accepted_tokens" not in steps.column_names:
        return {}
    rows = sorted(zip(steps["step"].to_pylist(), steps["id"].to_pylist(),
                      steps["num_accepted_tokens"].to_pylist()), key=lambda r: r[0])
    seen: dict[str, int] = {}
    accepted: dict[tuple[str, int], int] = {}
    for _, rid, a in rows:
        if a is None:                    # no drafts verified in this step
            continue
        i = seen.get(rid, 0)
        seen[rid] = i + 1
        accepted[(rid, i)] = a
    return accepted


def refuse_unsupported(trace: Trace) -> None:
    """What no engine replays yet, said before one is built."""
    cols = trace.requests.column_names
    if "mm_inputs" in cols and trace.requests["mm_inputs"].null_count < trace.requests.num_rows:
        row = trace.requests["mm_inputs"].is_valid().to_pylist().index(True)
        raise ReplayError(f"request {trace.requests['id'][row].as_py()!r} carries multimodal "
                          "inputs (their hashes enter its block hashes); multimodal replay "
                          "is not supported yet")
    if "lora_name" not in cols:
        return
    for rid, lora in zip(trace.requests["id"].to_pylist(),
                         trace.requests["lora_name"].to_pylist()):
        if lora is not None:
            raise ReplayError(f"request {rid!r} uses LoRA {lora!r}; LoRA replay "
                              "is not supported yet")


def engine_request(rows: Any, tokens: TokenSource, i: int, n_spec: int,
                   shortcuts: bool) -> EngineRequest:
    """Row ``i`` of a trace as the request the loop adds (a time segment's digest
    builds one it has not added yet the same way: segments/worker.py)."""
    prompt = tokens.prompt(i)
    blocks = tokens.prompt_blocks(i) if shortcuts else None
    output_len = rows.output_len[i]
    return EngineRequest(
        id=rows.ids[i], prompt_tokens=prompt.tolist(),
        output_tokens=tokens.output(i, output_len, n_spec + 1).tolist(),
        output_len=output_len, cache_salt=rows.cache_salt[i],
        priority=rows.priority[i] or 0,
        skip_reading_prefix_cache=bool(rows.skip_reading_prefix_cache[i]),
        prompt_block_ids=blocks[0] if blocks else None,
        prompt_block_tokens=blocks[1] if blocks else 0)


def run_targeted(engine: EngineAdapter, ev: Event, clock: int, arrived: bool | None) -> None:
    """An ``evict`` of cached GPU blocks, a ``store_remove`` of store keys, or a
    ``store_fault`` armed; an event that would touch nothing is an error, never a
    silent pass (a fault that never fires is reported with the replay)."""
    from replayer.replay.engines.base import UnsupportedByEngine
    from replayer.replay.store import StoreError

    head = f"event {ev.action} ({ev.why}) at step {clock}"
    try:
        if ev.action == "evict":
            if arrived is False:
                raise ReplayError(f"{head}: request {ev.target!r} has not arrived yet")
            try:
                n = engine.evict_cached_blocks(ev.target, ev.group)
            except ValueError as exc:
                raise ReplayError(f"{head}: {exc}") from None
            if n == 0:
                what = " and ".join(x for x in (
                    None if ev.target is None else f"request {ev.target!r}",
                    None if ev.group is None else f"group {ev.group}") if x)
                raise ReplayError(f"{head}: no cached block of {what} to evict")
        elif ev.action == "store_fault":
            engine.store_fault(ev.op, ev.keys, ev.code, ev.times)
        else:
            engine.store_remove(ev.keys)
    except (UnsupportedByEngine, StoreError) as exc:
        raise ReplayError(f"{head}: {exc}") from None


def replay(trace: Trace, engine: EngineAdapter,
           progress: Callable[[Progress], None] | None = None,
           shortcuts: bool = True,
           sink: Callable[[RequestOutcome], None] | None = None) -> ReplayResult:
    """Replay ``trace`` on ``engine`` (open, built for this trace) and collect what
    vLLM reported for every request. The caller owns the engine and closes it.

    ``shortcuts`` lets the engine skip work whose result it provably knows
    (prefix block hashes of repeated trace blocks); off, every request takes
    vLLM's plain path: the reference a shortcut must equal byte for byte.

    ``sink``, if given, receives each outcome in arrival order as soon as it and
    every earlier arrival have finished, and the result keeps none of them (only
    their totals, for the summary): memory then follows the live requests, not
    the trace length."""
    run = ReplayRun(trace, engine, progress=progress, shortcuts=shortcuts, sink=sink)
    run.run_to(None)
    return run.result()


class ReplayRun:
    """One replay that can pause at points of the step clock and go on later.

    :func:`replay` runs it to the end at once. A time segment
    (:mod:`replayer.replay.segments`) pauses it at a boundary ``t``: at the top
    of the first pass of the loop whose clock is at least ``t``, before that
    point's events and arrivals, where the engine's state is everything the
    rest of the replay depends on. It can also stop early, once the outcomes of
    the first ``n`` arrivals are handed on (:meth:`stop_after`).
    """

    #: Where the clock stands at a pause, with the loop's own counters.
    clock: int = 0
    steps_run: int = 0
    idle: int = 0
    since_progress: int = 0
    handed: int = 0                    # outcomes handed on, in arrival order

    def __init__(self, trace: Trace, engine: EngineAdapter,
                 progress: Callable[[Progress], None] | None = None,
                 shortcuts: bool = True,
                 sink: Callable[[RequestOutcome], None] | None = None) -> None:
        self.engine = engine
        self._t_start = time.perf_counter()
        self._pause_at = NEVER
        self._stop_after = NEVER
        self._loop = self._steps(trace, engine, progress, shortcuts, sink)
        self._done: ReplayResult | None = None

    def stop_after(self, handed: int | None) -> None:
        """End the replay once the outcomes of the first ``handed`` arrivals are
        handed on (None: at the end of the trace)."""
        self._stop_after = NEVER if handed is None else handed

    def run_to(self, point: int | None) -> bool:
        """Run until the clock reaches ``point`` (True, paused there) or the replay
        ends (False); None: to the end."""
        if self._done is not None:
            return False
        self._pause_at = NEVER if point is None else point
        with fewer_gc_passes():
            try:
                next(self._loop)
            except StopIteration as end:
                self._done = end.value
                return False
        return True

    def result(self) -> ReplayResult:
        """The replay's result, once it has ended."""
        if self._done is None:
            raise RuntimeError("the replay has not ended")
        return self._done

    def _steps(self, trace: Trace, engine: EngineAdapter,
               progress: Callable[[Progress], None] | None, shortcuts: bool,
               sink: Callable[[RequestOutcome], None] | None):
        """The replay loop, as a generator that yields at each pause: each pass runs
        the events and arrivals due, then one engine step and what it produced."""
        t_start = self._t_start
        s = _LoopState(trace, engine, shortcuts, sink)
        stopped = False
        while True:
            if s.clock >= self._pause_at:
                self._paused_at(s)
                yield
            if s.totals["requests"] >= self._stop_after:
                stopped = True
                break
            for ev in s.schedule.events_due(s.clock):
                s.run_event(ev)
            for i in s.schedule.arrivals_due(s.clock):
                s.add(i)
            if not engine.has_unfinished():
                s.hand_on()
                nxt = s.schedule.next_point()
                if nxt is None:
                    break
                s.clock = max(s.clock, nxt)
                continue
            res = s.step()
            s.model_output(res)
            s.finished(res)
            if progress is not None:
                progress(Progress(s.done, s.n, s.steps_run, s.prompt_done, s.cached_done))
        s.end(stopped)
        self._paused_at(s)
        return s.result(t_start)

    def _paused_at(self, s: "_LoopState") -> None:
        self.clock, self.steps_run, self.idle = s.clock, s.steps_run, s.idle
        self.since_progress, self.handed = s.since_progress, s.totals["requests"]


class _LoopState:
    """What the replay loop's passes share: the trace's rows, the requests arrived
    and not yet handed on, and the counters; one method for each thing that
    happens in a pass (an arrival, an event, an engine step, its model output,
    the requests it finished)."""

    def __init__(self, trace: Trace, engine: EngineAdapter, shortcuts: bool,
                 sink: Callable[[RequestOutcome], None] | None) -> None:
        refuse_unsupported(trace)
        self.engine = engine
        self.shortcuts = shortcuts
        self.sink = sink
        self.rows = request_rows(trace.requests)
        self.tokens = TokenSource(trace.header, trace.requests, trace.request_lists)
        self.n_spec = trace.engine.num_speculative_tokens
        accepted = recorded_accepted(trace)
        if accepted:
            engine.hold_accepted(accepted)
        engine.ask_top_logprobs(trace.logprob_topk)
        events = trace.events.to_pylist() if trace.events is not None else []
        self.schedule = Schedule(self.rows.arrival_step, self.rows.after, events)
        self.n = len(self.rows.ids)
        # Rows of the requests events name (abort and evict targets), found once.
        targets = {ev.get("target") for ev in events} - {None}
        self.target_row = ({rid: i for i, rid in enumerate(self.rows.ids) if rid in targets}
                           if targets else {})
        evicted = {ev["target"] for ev in events if ev["action"] == "evict"} - {None}
        if evicted:
            engine.track_blocks(evicted)
        self.arrived = np.zeros(self.n, dtype=bool)
        self.live: dict[str, int] = {}                  # arrived, not finished: id -> row
        self.pending: dict[int, RequestOutcome] = {}    # arrived, not yet handed on: row -> outcome
        self.order: deque[int] = deque()                # rows of pending, in arrival order
        self.kept: list[RequestOutcome] = []
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}   # handed on
        self.finished_engine_step: dict[str, int] = {}
        self.clock = self.steps_run = self.idle = self.done = 0
        self.prompt_done = self.cached_done = self.since_progress = 0

    def add(self, i: int) -> None:
        """Row ``i`` arrives: into the engine, and pending in arrival order."""
        request = engine_request(self.rows, self.tokens, i, self.n_spec, self.shortcuts)
        self.engine.add_request(request)
        self.tokens.release(i)            # a streamed trace drops the row's lists
        rid = request.id
        self.arrived[i] = True
        self.live[rid] = i
        self.order.append(i)
        self.pending[i] = RequestOutcome(id=rid, arrival_step=self.clock,
                                         num_prompt_tokens=len(request.prompt_tokens))

    def hand_on(self) -> None:
        """Outcomes at the front of arrival order that are complete, to the sink."""
        order, pending, totals = self.order, self.pending, self.totals
        while order and pending[order[0]].finish_step is not None:
            out = pending.pop(order.popleft())
            totals["requests"] += 1
            totals["prompt_tokens"] += out.num_prompt_tokens
            totals["cached_tokens"] += out.num_cached_tokens or 0
            if self.sink is None:
                self.kept.append(out)
            else:
                self.sink(out)
                # Nothing reads it any more (explain keeps every outcome):
                # memory follows the live requests.
                self.finished_engine_step.pop(out.id, None)
                self.engine.forget(out.id)

    def run_event(self, ev: Event) -> None:
        engine, clock = self.engine, self.clock
        if ev.action == "reset_prefix_cache":
            if not engine.reset_prefix_cache():
                raise ReplayError(f"event reset_prefix_cache ({ev.why}) failed at step {clock}: "
                                  "running requests still hold KV blocks")
        elif ev.action == "abort":
            row = self.target_row[ev.target]
            if not self.arrived[row]:
                raise ReplayError(f"event abort ({ev.why}) at step {clock}: request "
                                  f"{ev.target!r} has not arrived yet")
            if ev.target in self.live:
                engine.abort(ev.target)
                del self.live[ev.target]
                res = self.pending[row]
                res.aborted = True
                res.finish_step = clock
        elif ev.action in ("evict", "store_remove", "store_fault"):
            run_targeted(engine, ev, clock, arrived=None if ev.target is None
                         else bool(self.arrived[self.target_row[ev.target]]))
        else:  # validated when the trace was read
            raise ReplayError(f"unknown event action {ev.action!r}")

    def step(self) -> Any:
        """One engine step; a replay that stopped making progress is an error."""
        res = self.engine.step()
        self.clock += 1
        self.steps_run += 1
        self.idle = 0 if res.executed else self.idle + 1
        if self.idle >= MAX_IDLE_STEPS:
            waiting = [self.pending[i].id for i in self.order
                       if self.pending[i].finish_step is None]
            raise ReplayError(f"no progress for {MAX_IDLE_STEPS} steps at step {self.clock}: "
                              f"requests {waiting[:5]} can never be scheduled "
                              "(do they fit num_gpu_blocks and max_model_len?)")
        since = self.since_progress = 0 if res.finished else self.since_progress + 1
        if since >= MIN_STUCK_STEPS and since % MIN_STUCK_STEPS == 0:
            live_tokens = sum(self.pending[i].num_prompt_tokens + int(self.rows.output_len[i])
                              for i in self.live.values())
            if since > 2 * live_tokens:
                stuck = [self.pending[i].id for i in self.live.values()]
                raise ReplayError(f"no request finished in {since} steps at step "
                                  f"{self.clock}: requests {stuck[:5]} keep being preempted "
                                  "(does num_gpu_blocks hold them side by side?)")
        return res

    def model_output(self, res: Any) -> None:
        """A step's hits (a request's first prefill) and logprobs, onto the outcomes."""
        live, pending = self.live, self.pending
        for p in res.prefills:
            row = live.get(p.id)
            if row is None:
                continue
            r = pending[row]
            if r.num_cached_tokens is None:
                r.num_cached_tokens = p.num_cached_tokens
                r.num_local_cached_tokens = p.num_local_cached_tokens
                r.num_external_cached_tokens = p.num_external_cached_tokens
                r.prefill_step = self.clock - 1
                if p.group_hits is not None:
                    r.group_hits = list(p.group_hits)
        for rid, values in res.logprobs.items():
            row = live.get(rid)
            if row is not None:
                r = pending[row]
                r.logprobs = (r.logprobs or []) + values
        for rid, (top, prompt) in res.distributions.items():
            row = live.get(rid)
            if row is not None:
                pending[row].top_logprobs, pending[row].prompt_logprobs = top, prompt

    def finished(self, res: Any) -> None:
        """The requests a step finished, and the events and arrivals waiting on them."""
        for rid in res.finished:
            row = self.live.pop(rid, None)
            if row is None:         # aborted by an event already
                continue
            r = self.pending[row]
            if r.finish_step is None:
                r.finish_step = self.clock - 1
                self.finished_engine_step[rid] = self.steps_run
            self.done += 1
            self.prompt_done += r.num_prompt_tokens
            self.cached_done += r.num_cached_tokens or 0
            events_after, followers = self.schedule.after(rid)
            for ev in events_after:
                self.run_event(ev)
            for j in followers:
                self.add(j)
        if res.finished:
            self.hand_on()

    def end(self, stopped: bool) -> None:
        """The loop is over: every arrival must have come (unless stopped early)."""
        self.tokens.close()
        if not stopped and not self.arrived.all():
            unfinished = [self.rows.ids[int(i)] for i in np.flatnonzero(~self.arrived)[:5]]
            raise ReplayError(f"requests never arrived: {unfinished} (an 'after' chain that "
                              "never completes?)")
        self.hand_on()

    def result(self, t_start: float) -> ReplayResult:
        engine = self.engine
        return ReplayResult(engine=engine.info, requests=self.kept,
                            steps=self.steps_run, store=engine.store_report(),
                            kv_events=engine.kv_event_rows(),
                            kv_groups=engine.kv_groups(), notes=list(engine.notes),
                            streamed=None if self.sink is None else self.totals,
                            hit_alignment=engine.hit_alignment(), lookups=engine.lookups(),
                            min_gpu_blocks=engine.min_gpu_blocks(),
                            finished_engine_step=self.finished_engine_step,
                            hits_are_first_prefill=engine.hits_are_first_prefill(),
                            timings={"loop_s": time.perf_counter() - t_start,
                                     "vllm_s": engine.vllm_seconds()})
