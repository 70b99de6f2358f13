"""`replayer sweep`: one explained replay per grid point of engine settings, one table."""

from __future__ import annotations

import json
import sys

from replayer.cli.common import ENGINE_HELP, EXIT_OK, error, load_with_sets, no_server_opt, set_opt


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
    sw.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    no_server_opt(sw)
    set_opt(sw)


def run(args) -> int:
    from replayer.analysis.explain_tables import write_parquet_atomic
    from replayer.analysis.sweep import comparable, parse_grid, run_sweep, table_text
    from replayer.replay.engines.specs import parse_spec
    from traces.io.atomic import write_atomic

    parse_spec(args.engine)
    if args.jobs is not None and args.jobs < 1:
        return error("--jobs must be at least 1")
    keys, points = parse_grid(args.grid)
    trace = load_with_sets(args.target, args.set)     # bad input before any worker starts
    for p in points:
        from traces.scenarios.what_if import apply_sets

        apply_sets(trace.engine, p)
    if args.ray:
        executor, address = "ray", (None if args.ray == "local" else args.ray)
    else:
        executor, address = ("serial" if args.jobs == 1 else "pool"), None
    rows = run_sweep(args.target, points, engine_spec=args.engine, executor=executor,
                     workers=args.jobs, ray_address=address, base=args.set)
    print(table_text(keys, rows))
    where = f"Ray ({args.ray})" if args.ray else (
        "serially" if executor == "serial" else "on a local process pool")
    print(f"\n{len(points)} point(s) of {args.target} run {where}")
    text = json.dumps({"grid": keys, "base": args.set, "rows": comparable(rows)},
                      indent=2) + "\n"
    if args.parquet:
        import polars as pl

        write_parquet_atomic(args.parquet, pl.DataFrame(rows))
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        write_atomic(args.json, text)
    return EXIT_OK

