"""The stages in order, progress on stderr, limits, and the written scenario.

A relevance cut first (:mod:`.relevance`: what reached the engine after the
focus request's first prefill, or shares no block with it, in one or two
probes), then requests and events (ddmin), then prompts, then the engine, then ddmin once
more (a shorter prompt or a smaller cache can make another request
unnecessary), so the result is 1-minimal in requests and events. A limit or
Ctrl-C stops the search, never the output: the best case found so far is
written. The written scenario is compiled and replayed again, and must keep
the property (else nothing is written); its goldens go through the
``check --update-golden`` path, one engine after the other, and the file is
published with one atomic write.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from replayer.analysis.shrink.case import Case
from replayer.analysis.shrink.engine import shrink_engine
from replayer.analysis.shrink.prompts import shrink_prompts
from replayer.analysis.shrink.prop import LimitReached, Prober
from replayer.analysis.shrink.relevance import relevance_cut
from replayer.analysis.shrink.search import ddmin
from replayer.analysis.shrink.writer import roles, scenario_yaml
from traces import load_target


class ShrinkFailed(Exception):
    """Bad input or an output that would not keep the property (exit 2)."""


@dataclass
class Outcome:
    output: Path
    requests: tuple[int, int]
    events: tuple[int, int]
    tokens: tuple[int, int]
    probes: int
    seconds: float
    engine: dict[str, tuple] = field(default_factory=dict)
    stopped: str | None = None           # why the search stopped early (None: it finished)
    names: dict[str, str] = field(default_factory=dict)


def _clients(specs: list[str], worker: str = "null",
             wrap: Callable[[Any, Any], Any] | None = None) -> dict[str, Any]:
    """A client per engine text, each on ``worker`` (the warm server's when one runs);
    ``wrap(spec, client)``: the client the probes use instead (time segments)."""
    from replayer.replay.engines.sources.specs import parse_spec
    from replayer.replay.execution.clients import interpreter_seed_pinned, make_client

    # A bad spec (or one that cannot run a model) is said before anything runs.
    parsed = {s: parse_spec(s, worker) for s in specs}
    clients = {s: make_client(p, own_process=not interpreter_seed_pinned())
               for s, p in parsed.items()}
    return clients if wrap is None else {s: wrap(parsed[s], c) for s, c in clients.items()}


def _workers(clients: dict[str, Any]) -> int:
    if all(getattr(c, "parallel", False) for c in clients.values()):
        return max(2, os.cpu_count() or 2)
    return 1


def shrink(target: str, output: str, prop: Any, *, max_probes: int | None = None,
           timeout: float | None = None,
           say: Callable[[str], None] | None = None, worker: str = "null",
           wrap: Callable[[Any, Any], Any] | None = None) -> Outcome:
    """Shrink ``target`` keeping ``prop`` (:mod:`.prop`); write the scenario to ``output``;
    every probe replays on ``worker`` (``model``: vLLM's own model runner), through
    ``wrap(spec, client)``'s client where given (``--segments``)."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    trace = load_target(target)
    case0 = Case.from_trace(trace)
    request = getattr(prop, "request", None)
    if request is not None and request not in case0.ids:
        raise ShrinkFailed(f"{target}: no request {request!r} in the trace")
    if worker == "model":                   # refused in one line, before any engine starts
        from replayer.replay.engines.worker.models import NotOnThisWorker, check_geometry

        try:
            check_geometry(trace.sized_engine(), "--worker model")
        except NotOnThisWorker as exc:
            raise ShrinkFailed(f"{target}: {exc}") from None
    clients = _clients(prop.engines, worker, wrap)
    try:
        return _shrink(target, output, prop, case0, clients, max_probes, timeout, say)
    finally:
        for c in clients.values():
            c.close()


def _shrink(target, output, prop, case0, clients, max_probes, timeout, say) -> Outcome:
    first = prop.evaluate(case0, clients)
    if getattr(prop, "at_least", 0) is None:
        prop.at_least = first.value         # default: as many as the input loses
    if not first.holds:
        raise ShrinkFailed(f"{target}: the property does not hold on the input "
                           f"({prop.describe()}): the input gives {first.detail}")
    best = [case0]
    prober = Prober(prop, clients, max_probes=max_probes, timeout=timeout,
                    workers=_workers(clients))
    prober.note_floor(case0, first)
    stage = ["requests"]

    def line() -> str:
        c = best[0]
        return (f"shrink: {stage[0]}: {prober.probes} probe(s), {len(c.requests)} request(s), "
                f"{c.tokens} token(s) left, {prober.elapsed():.1f} s")

    def keep(case: Case) -> None:
        best[0] = case
        say(line())

    last_said = [0.0]

    def on_probe() -> None:
        if prober.elapsed() - last_said[0] >= 5:
            last_said[0] = prober.elapsed()
            say(line())

    prober.on_probe = on_probe
    say(f"shrink: {len(case0.requests)} request(s), {len(case0.events)} event(s), "
        f"{case0.tokens} token(s); keeping: {prop.describe()}; the input gives {first.detail}")
    engine_changes: dict[str, tuple] = {}
    stopped = _rounds(best, stage, first, getattr(prop, "request", None), prober, keep,
                      engine_changes)
    if prober.errors:
        say(f"shrink: {prober.errors} probe(s) could not replay (counted as losing the "
            f"property); the first: {prober.first_error}")
    if stopped:
        say(f"shrink: stopped ({stopped}); writing the best scenario found so far")
    say(line().replace(stage[0], "done", 1))
    return _write(target, output, prop, case0, best[0], clients, prober, engine_changes,
                  stopped, say)


def _rounds(best: list[Case], stage: list[str], first: Any, request: str | None,
            prober: Prober, keep, engine_changes: dict[str, tuple]) -> str | None:
    """Cut the requests that cannot matter, then up to three rounds of requests and
    events, prompts and engine settings (``best[0]``: the smallest case so far,
    ``stage[0]``: what is being cut, both for the progress line). Returns why it
    stopped early (a limit, ^C), else None; ``engine_changes`` gets each setting's
    first and last value."""
    protect = {request} if request else set()
    try:
        stage[0] = "requests that can matter"
        best[0] = relevance_cut(best[0], first, request or first.focus, prober, keep)
        for round_ in range(3):
            stage[0] = "requests and events"
            before = len(best[0].requests) + len(best[0].events)
            best[0] = _ddmin(best[0], protect, prober, keep)
            if round_ and len(best[0].requests) + len(best[0].events) == before:
                break
            stage[0] = "prompts"
            best[0] = shrink_prompts(best[0], prober, protect, keep)
            stage[0] = "engine"
            best[0], changes = shrink_engine(best[0], prober, keep)
            for k, (a, b) in changes.items():
                engine_changes[k] = (engine_changes.get(k, (a,))[0], b)
    except LimitReached as exc:
        return str(exc)
    except KeyboardInterrupt:
        return "interrupted"
    return None


def _ddmin(case: Case, protect: set[str], prober: Prober, keep) -> Case:
    items = [("request", r.id) for r in case.requests if r.id not in protect]
    items += [("event", i) for i in range(len(case.events))]

    def build(kept: list) -> Case:
        keep_set = set(kept)
        gone = {rid for kind, rid in items if kind == "request" and (kind, rid) not in keep_set}
        evs = {i for kind, i in items if kind == "event" and (kind, i) not in keep_set}
        return case.without(gone, evs)
    kept = ddmin(items, build, prober, on_keep=lambda k: keep(build(k)))
    return build(kept)


def _description(target, prop, case0: Case, best: Case, names, probes, changes,
                 stopped) -> str:
    focus = getattr(prop, "request", None)
    new_focus = names.get(focus) if focus else None
    engines = " and ".join(prop.engines)
    parts = [f"Shrunk by replayer shrink from {target}"
             + (f" (request {focus} there)" if focus else "") + f" on {engines}.",
             f"Keeps: {prop.describe(new_focus)}.",
             f"Shrinking removed {len(case0.requests) - len(best.requests)} of "
             f"{len(case0.requests)} requests ({len(best.requests)} left), "
             f"{len(case0.events) - len(best.events)} of {len(case0.events)} events, and "
             f"{case0.tokens - best.tokens} of {case0.tokens} prompt tokens "
             f"({best.tokens} left), in {probes} probes."]
    if changes:
        parts.append("Engine: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
                     + ".")
    parts.append("Ids in the input: " + ", ".join(f"{new} = {old}" for old, new in names.items())
                 + ".")
    if stopped:
        parts.append(f"The search stopped early ({stopped}): not minimal.")
    return " ".join(parts)


def _write(target, output, prop, case0, best, clients, prober, changes, stopped,
           say) -> Outcome:
    from replayer.check import goldens as golden_check
    from traces.io.atomic import write_atomic
    from traces.scenarios.compile import compile_scenario
    focus = getattr(prop, "request", None) or prop.evaluate(best, clients).focus
    names = roles(best, focus)
    text = scenario_yaml(best, names, _description(target, prop, case0, best, names,
                                                   prober.probes, changes, stopped))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.shrink-{os.getpid()}.yaml"
    try:
        work.write_text(text)
        written = Case.from_trace(compile_scenario(work))
        again = prop.evaluate(written, clients, names.get(prop.request) if getattr(
            prop, "request", None) else None)
        if not again.holds:
            raise ShrinkFailed(f"{output}: the written scenario does not keep the property "
                               f"({prop.describe()}): it gives {again.detail}; nothing was "
                               "written")
        for spec in prop.engines:          # each engine's own goldens, keyed by engine
            trace = compile_scenario(work)
            result = again.results.get(spec) or clients[spec](trace)
            key = result.engine.key
            if not trace.goldens:       # keyed from the first: the next engine keeps its own
                trace.goldens = {key: {}}
            if not trace.store_goldens:
                trace.store_goldens = {key: {}}
            golden_check.update(work, trace, result)
        write_atomic(out, work.read_bytes())
    finally:
        work.unlink(missing_ok=True)
    return Outcome(out, (len(case0.requests), len(best.requests)),
                   (len(case0.events), len(best.events)), (case0.tokens, best.tokens),
                   prober.probes, prober.elapsed(), changes, stopped, names)
