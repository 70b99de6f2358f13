"""The replay loop: feeds a trace's arrivals and events to an engine, step by step.

The step clock is the number of engine steps run so far. A request with
``arrival_step`` k enters before step k; one with ``after: X`` enters as soon as
X has finished, before the next step; an event ``after: X`` runs right when X
finishes, before any request that arrives after X; an event ``at_step: k``
runs before step k. When the engine has nothing to do the clock jumps to the
next arrival, so idle time costs nothing. Within one point of the clock,
things happen in trace row order. Nothing here knows which vLLM runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from math import ceil
from typing import Any, Callable

from traces import Trace
from traces.materialize import TokenSource, request_rows

from .determinism import engine_hash_seed
from .engines import EngineAdapter, EngineInfo, EngineRequest, open_engine
from .engines.specs import runs_in_this_process

# A step in which nothing could be scheduled, this many times running, means the
# trace can never finish (a prompt that does not fit the KV cache, say).
MAX_IDLE_STEPS = 1000


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
    requests: list[dict[str, Any]]
    steps: int
    # Store operations and lookups when the trace has a connector (see store_json).
    store: dict[str, Any] | None = None
    # vLLM's KV-cache groups in its own order (kind, EAGLE drop), when the adapter tells.
    kv_groups: list[dict[str, Any]] | None = None
    # Tokens every prefix hit is a multiple of (vLLM's cache_hit_alignment_tokens),
    # when the adapter tells; not part of the JSON.
    hit_alignment: int | None = None
    # When each request last looked up the prefix cache, (engine step, lookup
    # number), and the engine step it finished in (steps counted as run, not
    # the clock): who could see whose prefix. Adapters that tell; not in the JSON.
    lookups: dict[str, tuple[int, int]] | None = None
    finished_engine_step: dict[str, int] = field(default_factory=dict)
    # Settings of the trace this engine does not have, and how it replayed
    # without them (older releases); said on stderr, never part of the JSON.
    notes: list[str] = field(default_factory=list)
    # Timings: never part of the deterministic output.
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        prompt = sum(r["num_prompt_tokens"] for r in self.requests)
        cached = sum(r["num_cached_tokens"] or 0 for r in self.requests)
        return {"requests": len(self.requests), "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
                "steps": self.steps}

    def as_dict(self) -> dict[str, Any]:
        out = {"engine": self.engine.as_dict(), "requests": self.requests,
               "summary": self.summary()}
        if self.kv_groups is not None:
            out["kv_groups"] = self.kv_groups
        if self.store is not None:
            out["store"] = store_json(self.store)
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


def recorded_accepted(trace: Trace) -> dict[tuple[int, str], int]:
    """(step, request) -> drafts accepted in the recording's steps table, where known.

    Replay holds the null model to these, so a recording where drafts were
    rejected replays the same schedule (the null model would accept all)."""
    steps = trace.steps
    if steps is None or "num_accepted_tokens" not in steps.column_names:
        return {}
    return {(s, rid): a for s, rid, a in zip(steps["step"].to_pylist(), steps["id"].to_pylist(),
                                              steps["num_accepted_tokens"].to_pylist())
            if a is not None}


def default_max_model_len(trace: Trace, extra: int) -> int:
    rows = trace.requests
    longest = max(n + o for n, o in zip(rows["num_prompt_tokens"].to_pylist(),
                                        rows["output_len"].to_pylist()))
    return longest + extra


def resolved_engine(trace: Trace) -> tuple[dict[str, Any], int, int]:
    """The engine block with the replayer's documented defaults filled in.

    ``max_model_len``: longest prompt + output (+ draft room), rounded up to
    the largest block; ``num_gpu_blocks``: room for four such requests in every
    group. Returns (engine, max_model_len, draft tokens per step).
    """
    engine = dict(trace.engine)
    spec = engine.get("speculative") or {}
    n_spec = int(spec.get("num_speculative_tokens", 1)) if spec else 0
    sizes = [g.get("block_size", engine.get("block_size", 16)) for g in engine["kv_groups"]]
    unit = max(sizes)
    max_len = engine.get("max_model_len")
    if max_len is None:
        max_len = ceil(default_max_model_len(trace, n_spec + 1) / unit) * unit
    if "num_gpu_blocks" not in engine:
        engine["num_gpu_blocks"] = 4 * ceil(max_len / min(sizes)) * len(sizes)
    return engine, int(max_len), n_spec


def replay(trace: Trace, engine_spec: Any = "installed",
           progress: Callable[[Progress], None] | None = None,
           engine: EngineAdapter | None = None, store: Any = None) -> ReplayResult:
    """Replay ``trace`` and collect what vLLM reported for every request.

    ``engine_spec`` is ``installed``, ``vllm==X.Y.Z`` or a vLLM source tree
    (see :mod:`replayer.engines.specs`); any but the installed vLLM replays in
    a child process of its own, with the same result."""
    if engine is None and not runs_in_this_process(engine_spec):
        from .engine_process import EngineProcess

        with EngineProcess(engine_spec) as child:
            return child.replay(trace, progress=progress, store=store)
    t_start = time.perf_counter()
    header_engine, max_len, n_spec = resolved_engine(trace)
    rows = request_rows(trace.requests)
    for i, lora in enumerate(rows.lora_name):
        if lora is not None:
            raise ReplayError(f"request {rows.ids[i]!r} uses LoRA {lora!r}; LoRA replay "
                              "is not supported yet")
    tokens = TokenSource(trace.header, trace.requests)
    owns_engine = engine is None
    if engine is None:
        with engine_hash_seed(header_engine):
            engine = open_engine(header_engine, max_len, engine_spec, store=store)
    t_ready = time.perf_counter()
    hold = getattr(engine, "hold_accepted", None)
    if hold is not None and trace.steps is not None:
        accepted = recorded_accepted(trace)
        if accepted:
            hold(accepted)
    n = len(rows.ids)
    index = {rid: i for i, rid in enumerate(rows.ids)}
    timed = sorted((rows.arrival_step[i] or 0, i) for i in range(n) if rows.after[i] is None)
    after_reqs: dict[str, list[int]] = defaultdict(list)
    for i in range(n):
        if rows.after[i] is not None:
            after_reqs[rows.after[i]].append(i)
    step_events: list[tuple[int, int, dict[str, Any]]] = []
    after_events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if trace.events is not None:
        for j, ev in enumerate(trace.events.to_pylist()):
            if ev["after"] is not None:
                after_events[ev["after"]].append(ev)
            else:
                step_events.append((ev["at_step"], j, ev))
    step_events.sort(key=lambda e: (e[0], e[1]))

    results: list[dict[str, Any] | None] = [None] * n
    finished_engine_step: dict[str, int] = {}
    order: list[int] = []
    clock = 0
    steps_run = 0
    idle = 0
    done = 0
    prompt_done = 0
    cached_done = 0
    ptr = 0
    eptr = 0

    def add(i: int) -> None:
        rid = rows.ids[i]
        prompt = tokens.prompt(i)
        engine.add_request(EngineRequest(
            id=rid, prompt_tokens=prompt.tolist(),
            output_tokens=tokens.output(i, rows.output_len[i], n_spec + 1).tolist(),
            output_len=rows.output_len[i], cache_salt=rows.cache_salt[i],
            priority=rows.priority[i] or 0))
        order.append(i)
        results[i] = {"id": rid, "arrival_step": clock, "num_prompt_tokens": len(prompt),
                      "num_cached_tokens": None, "num_local_cached_tokens": None,
                      "num_external_cached_tokens": None, "prefill_step": None,
                      "finish_step": None, "aborted": False}

    def run_event(ev: dict[str, Any], why: str) -> None:
        if ev["action"] == "reset_prefix_cache":
            if not engine.reset_prefix_cache():
                raise ReplayError(f"event reset_prefix_cache ({why}) failed at step {clock}: "
                                  "running requests still hold KV blocks")
        elif ev["action"] == "abort":
            target = ev["target"]
            res = results[index[target]]
            if res is None:
                raise ReplayError(f"event abort ({why}) at step {clock}: request {target!r} "
                                  "has not arrived yet")
            if res["finish_step"] is None:
                engine.abort(target)
                res["aborted"] = True
                res["finish_step"] = clock
        else:  # validated when the trace was read
            raise ReplayError(f"unknown event action {ev['action']!r}")

    try:
        while True:
            while eptr < len(step_events) and step_events[eptr][0] <= clock:
                run_event(step_events[eptr][2], f"at_step {step_events[eptr][0]}")
                eptr += 1
            while ptr < len(timed) and timed[ptr][0] <= clock:
                add(timed[ptr][1])
                ptr += 1
            if not engine.has_unfinished():
                nxt = [timed[ptr][0]] if ptr < len(timed) else []
                if eptr < len(step_events):
                    nxt.append(step_events[eptr][0])
                if not nxt:
                    break
                clock = max(clock, min(nxt))
                continue
            res = engine.step()
            clock += 1
            steps_run += 1
            idle = 0 if res.executed else idle + 1
            if idle >= MAX_IDLE_STEPS:
                waiting = [rows.ids[i] for i in order if results[i]["finish_step"] is None]
                raise ReplayError(f"no progress for {MAX_IDLE_STEPS} steps at step {clock}: "
                                  f"requests {waiting[:5]} can never be scheduled "
                                  "(do they fit num_gpu_blocks and max_model_len?)")
            for p in res.prefills:
                r = results[index[p.id]]
                if r["num_cached_tokens"] is None:
                    r.update(num_cached_tokens=p.num_cached_tokens,
                             num_local_cached_tokens=p.num_local_cached_tokens,
                             num_external_cached_tokens=p.num_external_cached_tokens,
                             prefill_step=clock - 1)
                    if p.group_hits is not None:
                        r["group_hits"] = list(p.group_hits)
            for rid in res.finished:
                i = index[rid]
                r = results[i]
                if r["finish_step"] is None:
                    r["finish_step"] = clock - 1
                    finished_engine_step[rid] = steps_run
                done += 1
                prompt_done += r["num_prompt_tokens"]
                cached_done += r["num_cached_tokens"] or 0
                for ev in after_events.get(rid, ()):
                    run_event(ev, f"after {rid}")
                for j in after_reqs.get(rid, ()):
                    add(j)
            if progress is not None:
                progress(Progress(done, n, steps_run, prompt_done, cached_done))
        report = getattr(engine, "store_report", lambda: None)()
        kv_groups = getattr(engine, "kv_groups", lambda: None)()
        hit_alignment = getattr(engine, "hit_alignment", lambda: None)()
        lookups = getattr(engine, "lookups", lambda: None)()
    finally:
        vllm_s = engine.vllm_seconds()
        if owns_engine:
            engine.close()
    t_end = time.perf_counter()
    unfinished = [rows.ids[i] for i in range(n) if results[i] is None]
    if unfinished:
        raise ReplayError(f"requests never arrived: {unfinished[:5]} (an 'after' chain that "
                          "never completes?)")
    out = [results[i] for i in order]
    return ReplayResult(engine=engine.info, requests=out, steps=steps_run, store=report,
                        kv_groups=kv_groups, hit_alignment=hit_alignment, lookups=lookups,
                        finished_engine_step=finished_engine_step,
                        notes=list(getattr(engine, "notes", ())), timings={
        "startup_s": t_ready - t_start, "loop_s": t_end - t_ready, "wall_s": t_end - t_start,
        "vllm_s": vllm_s})
