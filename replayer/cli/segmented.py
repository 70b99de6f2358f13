"""``--segments K``: the options, and a runner that replays each trace in time segments.

``run``, ``explain`` and ``sweep`` take the same options. A trace that cannot
split (``after:`` chains, a connector, KV-cache events, targeted events, an
engine without a state digest) replays in one piece, said in one line; the
output is the same either way. What each segmented replay did (boundaries
matched, segments replayed again, speed-up) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from traces import TraceError

PREFIX = "replayer: segments: "


def segment_opts(sp: argparse.ArgumentParser, ray: bool = True, digests: bool = False) -> None:
    from replayer.replay.segments.plan import DEFAULT_WARM_UP

    g = sp.add_argument_group("time segments")
    g.add_argument("--segments", type=int, default=1, metavar="K",
                   help="split the trace into K time segments replayed at once, each proven "
                        "exact at its boundary (the output is the sequential replay's)")
    g.add_argument("--warm-up", default=DEFAULT_WARM_UP, metavar="DURATION",
                   help="trace time each segment replays before its boundary, from an empty "
                        f"engine: 2m, 90s, 500ms or 3000steps (default {DEFAULT_WARM_UP})")
    if ray:
        g.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                       help="run the segments on a Ray cluster (auto, ray://HOST:PORT; "
                            "no ADDRESS: a Ray instance started here)")
        g.add_argument("--jobs", type=int, default=None, metavar="N",
                       help="local worker processes for the segments (default: the cores "
                            "there are; 1: in this process, one after another)")
    if digests:
        g.add_argument("--segment-digests", action="store_true",
                       help="put each boundary's state digests in --json")


def check_segment_opts(args) -> None:
    """Bad values are named before anything runs."""
    if args.segments < 1:
        raise TraceError("--segments", "must be at least 1")
    if getattr(args, "jobs", None) is not None and args.jobs < 1:
        raise TraceError("--jobs", "must be at least 1")
    if args.segments > 1 and getattr(args, "worker", "null") == "model":
        raise TraceError("--segments", "not with --worker model: a boundary is proven by the "
                                       "engine's state digest, which does not read a model "
                                       "runner's state")


def start_workers_early(args, spec: Any) -> None:
    """Where the segments will run on a local pool, start its fork server before
    the trace is read: vLLM's import there overlaps the reading."""
    if args.segments < 2 or getattr(args, "ray", None) or getattr(args, "jobs", None) == 1:
        return
    from replayer.replay.engines.sources.specs import resolve
    from replayer.replay.segments.hosts import start_fork_server

    if resolve(spec).runs_here():
        start_fork_server(getattr(args, "verbose", False))


def make_host(args, segments: int, spec: Any = None) -> Any:
    from replayer.replay.engines.sources.specs import resolve
    from replayer.replay.segments.hosts import make_host as make

    return make(getattr(args, "ray", None), getattr(args, "jobs", None), segments,
                getattr(args, "verbose", False), None if spec is None else resolve(spec))


class SegmentedRunner:
    """Replays traces in ``args.segments`` segments on one host kept for them all
    (its processes import vLLM once); a trace that cannot split replays through
    ``fallback``. Each replay's report lines go to stderr."""

    def __init__(self, args, spec: Any, fallback: Any) -> None:
        self.args = args
        self.spec = spec
        self.fallback = fallback
        self.host = None
        self.reports: list[Any] = []
        self.said: set[str] = set()

    def __call__(self, trace, label: str | None = None):
        from replayer.cli.common import say_notes, store_spec
        from replayer.replay.segments import replay_segments, warm_up_steps
        from replayer.replay.segments.worker import serial_reason

        store = store_spec(self.args) if hasattr(self.args, "store") else None
        why = serial_reason(trace, self.spec, store)
        if why is not None:
            line = f"replayer: note: --segments: replayed in one piece: {why}"
            if line not in self.said:
                self.said.add(line)
                print(line, file=sys.stderr)
            return self.fallback(trace)
        warm = warm_up_steps(self.args.warm_up, trace)
        if self.host is None:
            self.host = make_host(self.args, self.args.segments, self.spec)
        result, report = replay_segments(
            trace, self.host, self.args.segments, warm, self.args.warm_up, spec=self.spec,
            shortcuts=not getattr(self.args, "no_shortcuts", False),
            say=lambda msg: print(PREFIX + msg, file=sys.stderr), store=store)
        self.reports.append(report)
        lines = report.lines()
        if label is not None:
            lines = [f"{label}: {line}" for line in lines]
        for line in lines:
            print(PREFIX + line, file=sys.stderr)
        say_notes(result)
        return result

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None

    def __enter__(self) -> "SegmentedRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# A shrink probe this long or longer replays in segments (--segments): each
# segment's engine build and warm-up cost about a second on these machines, so
# a split of a shorter probe (most of a shrink's, once it has cut the input
# down) saves less than it costs, and those replay through the client itself.
LONG_PROBE_REQUESTS = 1000


class SegmentedClient:
    """An engine client whose long replays (at least :data:`LONG_PROBE_REQUESTS`
    requests, nothing else asked of them) run in time segments; the rest, and
    batches side by side, through ``client`` itself. The output is the same."""

    def __init__(self, client: Any, runner: SegmentedRunner) -> None:
        self.client = client
        self.runner = runner
        self.info = client.info
        self.in_process = client.in_process
        self.parallel = client.parallel

    def _long(self, trace) -> bool:
        return trace.requests.num_rows >= LONG_PROBE_REQUESTS

    def __call__(self, trace, **kw: Any):
        if kw or not self._long(trace):
            return self.client(trace, **kw)
        return self.runner(trace, label="probe")

    def replay_many(self, traces, store: Any = None) -> list[Any]:
        if store is not None or not any(self._long(t) for t in traces):
            return self.client.replay_many(traces, store=store)
        return [self(t) for t in traces]

    def close(self) -> None:
        self.runner.close()
        self.client.close()


def long_probes_in_segments(args) -> Any:
    """shrink's ``wrap``: None without ``--segments``, else each engine's client
    with its long probes in segments (a host of its own per engine)."""
    if args.segments < 2:
        return None
    return lambda spec, client: SegmentedClient(client, SegmentedRunner(args, spec, client))

