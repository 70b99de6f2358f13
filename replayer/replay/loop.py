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
from traces.model.materialize import TokenSource, request_rows
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
        """The replay loop, as a generator that yields at each pause."""
        t_start = self._t_start
        refuse_unsupported(trace)
        rows = request_rows(trace.requests)
        tokens = TokenSource(trace.header, trace.requests, trace.request_lists)
        n_spec = trace.engine.num_speculative_tokens
        accepted = recorded_accepted(trace)
        if accepted:
            engine.hold_accepted(accepted)
        engine.ask_top_logprobs(trace.logprob_topk)
        events = trace.events.to_pylist() if trace.events is not None else []
        schedule = Schedule(rows.arrival_step, rows.after, events)
        n = len(rows.ids)
        # Rows of the requests events name (abort and evict targets), found once.
        targets = {ev.get("target") for ev in events} - {None}
        target_row = {rid: i for i, rid in enumerate(rows.ids) if rid in targets} if targets else {}
        evicted = {ev["target"] for ev in events if ev["action"] == "evict"} - {None}
        if evicted:
            engine.track_blocks(evicted)
        arrived = np.zeros(n, dtype=bool)
        live: dict[str, int] = {}                         # arrived, not finished: id -> row
        pending: dict[int, RequestOutcome] = {}          # arrived, not yet handed on: row -> outcome
        order: deque[int] = deque()                       # rows of pending, in arrival order
        kept: list[RequestOutcome] = []
        totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}   # of handed-on outcomes
        finished_engine_step: dict[str, int] = {}
        clock = steps_run = idle = done = prompt_done = cached_done = 0
        since_progress = 0
        stopped = False

        def add(i: int) -> None:
            prompt = tokens.prompt(i)
            blocks = tokens.prompt_blocks(i) if shortcuts else None
            rid = rows.ids[i]
            output_len = rows.output_len[i]
            engine.add_request(EngineRequest(
                id=rid, prompt_tokens=prompt.tolist(),
                output_tokens=tokens.output(i, output_len, n_spec + 1).tolist(),
                output_len=output_len, cache_salt=rows.cache_salt[i],
                priority=rows.priority[i] or 0,
                skip_reading_prefix_cache=bool(rows.skip_reading_prefix_cache[i]),
                prompt_block_ids=blocks[0] if blocks else None,
                prompt_block_tokens=blocks[1] if blocks else 0))
            tokens.release(i)                 # a streamed trace drops the row's lists
            arrived[i] = True
            live[rid] = i
            order.append(i)
            pending[i] = RequestOutcome(id=rid, arrival_step=clock, num_prompt_tokens=len(prompt))

        def hand_on() -> None:
            """Outcomes at the front of arrival order that are complete, to the sink."""
            while order and pending[order[0]].finish_step is not None:
                out = pending.pop(order.popleft())
                totals["requests"] += 1
                totals["prompt_tokens"] += out.num_prompt_tokens
                totals["cached_tokens"] += out.num_cached_tokens or 0
                if sink is None:
                    kept.append(out)
                else:
                    sink(out)
                    # Nothing reads it any more (explain keeps every outcome):
                    # memory follows the live requests.
                    finished_engine_step.pop(out.id, None)
                    engine.forget(out.id)

        def run_event(ev: Event) -> None:
            if ev.action == "reset_prefix_cache":
                if not engine.reset_prefix_cache():
                    raise ReplayError(f"event reset_prefix_cache ({ev.why}) failed at step {clock}: "
                                      "running requests still hold KV blocks")
            elif ev.action == "abort":
                row = target_row[ev.target]
                if not arrived[row]:
                    raise ReplayError(f"event abort ({ev.why}) at step {clock}: request "
                                      f"{ev.target!r} has not arrived yet")
                if ev.target in live:
                    engine.abort(ev.target)
                    del live[ev.target]
                    res = pending[row]
                    res.aborted = True
                    res.finish_step = clock
            elif ev.action in ("evict", "store_remove", "store_fault"):
                run_targeted(engine, ev, clock,
                             arrived=None if ev.target is None else bool(arrived[target_row[ev.target]]))
            else:  # validated when the trace was read
                raise ReplayError(f"unknown event action {ev.action!r}")

        while True:
            if clock >= self._pause_at:
                self.clock, self.steps_run, self.idle = clock, steps_run, idle
                self.since_progress, self.handed = since_progress, totals["requests"]
                yield
            if totals["requests"] >= self._stop_after:
                stopped = True
                break
            for ev in schedule.events_due(clock):
                run_event(ev)
            for i in schedule.arrivals_due(clock):
                add(i)
            if not engine.has_unfinished():
                hand_on()
                nxt = schedule.next_point()
                if nxt is None:
                    break
                clock = max(clock, nxt)
                continue
            res = engine.step()
            clock += 1
            steps_run += 1
            idle = 0 if res.executed else idle + 1
            if idle >= MAX_IDLE_STEPS:
                waiting = [pending[i].id for i in order if pending[i].finish_step is None]
                raise ReplayError(f"no progress for {MAX_IDLE_STEPS} steps at step {clock}: "
                                  f"requests {waiting[:5]} can never be scheduled "
                                  "(do they fit num_gpu_blocks and max_model_len?)")
            since_progress = 0 if res.finished else since_progress + 1
            if since_progress >= MIN_STUCK_STEPS and since_progress % MIN_STUCK_STEPS == 0:
                live_tokens = sum(pending[i].num_prompt_tokens + int(rows.output_len[i])
                                  for i in live.values())
                if since_progress > 2 * live_tokens:
                    stuck = [pending[i].id for i in live.values()]
                    raise ReplayError(f"no request finished in {since_progress} steps at step "
                                      f"{clock}: requests {stuck[:5]} keep being preempted "
                                      "(does num_gpu_blocks hold them side by side?)")
            for p in res.prefills:
                row = live.get(p.id)
                if row is None:
                    continue
                r = pending[row]
                if r.num_cached_tokens is None:
                    r.num_cached_tokens = p.num_cached_tokens
                    r.num_local_cached_tokens = p.num_local_cached_tokens
                    r.num_external_cached_tokens = p.num_external_cached_tokens
                    r.prefill_step = clock - 1
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
            for rid in res.finished:
                row = live.pop(rid, None)
                if row is None:         # aborted by an event already
                    continue
                r = pending[row]
                if r.finish_step is None:
                    r.finish_step = clock - 1
                    finished_engine_step[rid] = steps_run
                done += 1
                prompt_done += r.num_prompt_tokens
                cached_done += r.num_cached_tokens or 0
                events_after, followers = schedule.after(rid)
                for ev in events_after:
                    run_event(ev)
                for j in followers:
                    add(j)
            if res.finished:
                hand_on()
            if progress is not None:
                progress(Progress(done, n, steps_run, prompt_done, cached_done))
        tokens.close()
        if not stopped and not arrived.all():
            unfinished = [rows.ids[int(i)] for i in np.flatnonzero(~arrived)[:5]]
            raise ReplayError(f"requests never arrived: {unfinished} (an 'after' chain that "
                              "never completes?)")
        hand_on()
        self.clock, self.steps_run, self.idle = clock, steps_run, idle
        self.since_progress, self.handed = since_progress, totals["requests"]
        return ReplayResult(engine=engine.info, requests=kept,
                            steps=steps_run, store=engine.store_report(),
                            kv_events=engine.kv_event_rows(),
                            kv_groups=engine.kv_groups(), notes=list(engine.notes),
                            streamed=None if sink is None else totals,
                            hit_alignment=engine.hit_alignment(), lookups=engine.lookups(),
                            min_gpu_blocks=engine.min_gpu_blocks(),
                            finished_engine_step=finished_engine_step,
                            hits_are_first_prefill=engine.hits_are_first_prefill(),
                            timings={"loop_s": time.perf_counter() - t_start,
                                     "vllm_s": engine.vllm_seconds()})
