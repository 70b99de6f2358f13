"""`replayer import`: a public trace format (Mooncake's) as a trace directory."""

from __future__ import annotations

from pathlib import Path

from replayer.cli.common import EXIT_OK, error, force_opt, plan_output, say
from traces import TraceError


def add_parser(sub) -> None:
    imp = sub.add_parser("import", help="import a public trace format")
    imp.add_argument("format", choices=["mooncake"])
    imp.add_argument("file")
    imp.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(imp)
    imp.add_argument("--limit", type=int, help="only the first N requests")
    imp.add_argument("--engine", metavar="ENGINE.yaml", help="YAML file with an engine: block")
    imp.add_argument("--step-ms", type=int, default=None,
                     help="milliseconds of production time per engine step (default 20)")


def run(args) -> int:
    from traces.importers.mooncake import import_mooncake
    from traces.model.step_clock import DEFAULT_STEP_MS
    from traces.trace import write_trace

    if args.limit is not None and args.limit < 1:
        return error("--limit must be at least 1")
    step_ms = DEFAULT_STEP_MS if args.step_ms is None else args.step_ms
    if step_ms < 1:
        return error("--step-ms must be at least 1")
    notes = plan_output(args, [args.file])
    engine = engine_yaml(args.engine) if args.engine else None
    trace = import_mooncake(args.file, limit=args.limit, engine=engine, step_ms=step_ms)
    out = write_trace(trace, args.output, force=args.force, inputs=(args.file,))
    say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests)")
    return EXIT_OK



def engine_yaml(path: str):
    from traces.model.engine_spec import EngineBlock
    from traces.scenarios.compile import load_yaml

    p = Path(path)
    data = load_yaml(p)
    for key in data:
        if key != "engine":
            raise TraceError(p, f"unknown key {key!r} (an engine file holds only 'engine:')")
    if "engine" not in data:
        raise TraceError(p, "no 'engine:' block")
    from traces.model.sanity import check_async_scheduling

    engine = EngineBlock.from_dict(str(p), data["engine"])
    check_async_scheduling(p, engine, "imported")
    return engine

