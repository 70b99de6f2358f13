"""`replayer sweep`: one explained replay per grid point of engine settings, one table."""

from __future__ import annotations

import json
import sys

from replayer.cli.common import (
    ENGINE_HELP,
    EXIT_OK,
    check_worker,
    error,
    load_with_sets,
    no_server_opt,
    set_opt,
    worker_opt,
    write_output,
)
from replayer.cli.segmented import segment_opts


def add_parser(sub) -> None:
    sw = sub.add_parser("sweep", help="one explained replay per grid point, one table")
    sw.add_argument("target", help="scenario .yaml or trace directory")
    sw.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                    help="an engine key and its values (repeatable: the grid is the product)")
    sw.add_argument("--jobs", type=int, default=None,
                    help="local worker processes (default: the cores there are; 1: serial)")
    sw.add_argument("--ray", metavar="ADDRESS",
                    help="run the points on a Ray cluster ('auto', ray://HOST:PORT, or "
                         "'local' for a Ray instance started here; needs the ray extra)")
    sw.add_argument("--json", metavar="OUT", help="write the table as JSON, wall times left "
                                                  "out ('-' for stdout)")
    sw.add_argument("--parquet", metavar="OUT", help="write the table as Parquet")
    sw.add_argument("--engine", default="installed", metavar="SPEC", help=ENGINE_HELP)
    worker_opt(sw)
    sw.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    no_server_opt(sw)
    set_opt(sw, allow_missing=False)
    segment_opts(sw, ray=False)


def run(args) -> int:
    from replayer.analysis.explain_tables import write_parquet_atomic
    from replayer.analysis.sweep import comparable, parse_grid, run_sweep, table_text
    from replayer.replay.engines.sources.specs import parse_spec

    from replayer.cli.segmented import check_segment_opts

    spec = parse_spec(args.engine, args.worker)
    # The model worker's spec travels as parsed (it names the worker); the null
    # executor's as the text given, as before.
    engine_spec = spec if args.worker == "model" else args.engine
    if args.jobs is not None and args.jobs < 1:
        return error("--jobs must be at least 1")
    keys, points = parse_grid(args.grid)
    trace = load_with_sets(args.target, args.set)     # bad input before any worker starts
    check_worker(trace, spec, args.target)
    for p in points:
        from traces.scenarios.what_if import apply_sets

        apply_sets(trace.engine, p)
    if args.ray:
        executor, address = "ray", (None if args.ray == "local" else args.ray)
    else:
        executor, address = ("serial" if args.jobs == 1 else "pool"), None
    check_segment_opts(args)
    if args.segments > 1:
        from replayer.replay.segments import warm_up_steps

        warm_up_steps(args.warm_up, trace)    # a bad --warm-up is named before any replay
    reports: list = []
    rows = run_sweep(args.target, points, engine_spec=engine_spec, executor=executor,
                     workers=args.jobs, ray_address=address, base=args.set,
                     segments=args.segments, warm_up=args.warm_up, reports=reports)
    print(table_text(keys, rows))
    where = f"Ray ({args.ray})" if args.ray else (
        "serially" if executor == "serial" else "on a local process pool")
    if args.segments > 1:
        where = (f"one after another, each replay in {args.segments} time segments "
                 + ("in this process" if executor == "serial" else where))
    print(f"\n{len(points)} point(s) of {args.target} run {where}")
    if args.segments > 1:
        say_segment_totals(reports, len(points))
    text = json.dumps({"grid": keys, "base": args.set, "rows": comparable(rows)},
                      indent=2) + "\n"
    if args.parquet:
        import polars as pl

        write_parquet_atomic(args.parquet, pl.DataFrame(rows))
    write_output(args.json, text)
    return EXIT_OK



def say_segment_totals(reports: list, points: int) -> None:
    """Boundaries matched over every segmented replay of the sweep (stderr)."""
    for why in dict.fromkeys(r for r in reports if isinstance(r, str)):
        print(f"replayer: note: --segments: replayed in one piece: {why}", file=sys.stderr)
    reports = [r for r in reports if not isinstance(r, str)]
    checks = [c for r in reports for c in r.checks]
    matched = sum(c.matched for c in checks)
    wall = sum(r.wall_s for r in reports)
    own = sum(r.sequential_s for r in reports)
    speed = f"about {own / wall:.1f}x sequential replays" if wall else "no segmented replay"
    print(f"replayer: segments: {len(reports)} replay(s) of {points} point(s) in segments; "
          f"boundaries matched: {matched} of {len(checks)}; {wall:.1f} s wall, the exact "
          f"paths' own replay time {own:.1f} s: {speed}", file=sys.stderr)
