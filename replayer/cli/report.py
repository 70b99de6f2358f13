"""`replayer report`: the explained replay as a self-contained HTML page."""

from __future__ import annotations

import json
from pathlib import Path

from replayer.cli.common import (
    EXIT_OK,
    check_worker,
    engine_opts,
    explain_target,
    load_with_sets,
    note_skipped,
    set_opt,
    store_spec,
)
from traces import TraceError


def add_parser(sub) -> None:
    rep = sub.add_parser("report", help="a self-contained HTML page: hit rate over time, "
                                        "reachable vs actual, lost by cause, per-group hits")
    rep.add_argument("target", help="scenario .yaml or trace directory")
    rep.add_argument("-o", "--output", required=True, metavar="OUT.html")
    rep.add_argument("--sweep", metavar="SWEEP.json",
                     help="also plot a sweep's hit rate against each swept key "
                          "(the --json of replayer sweep)")
    engine_opts(rep)
    set_opt(rep)


def run(args) -> int:
    from replayer.analysis.html_report import render_html
    from replayer.replay.engines.sources.specs import parse_spec
    from replayer.replay.execution.clients import engine_runner
    from traces.io.atomic import write_atomic

    spec = parse_spec(args.engine, args.worker)
    sweep = None
    if args.sweep:
        try:
            sweep = json.loads(Path(args.sweep).read_text())
        except OSError as exc:
            raise TraceError(args.sweep, f"cannot read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise TraceError(args.sweep, f"invalid JSON: {exc.msg}") from None
        if not isinstance(sweep, dict) or not isinstance(sweep.get("grid"), list) \
                or not isinstance(sweep.get("rows"), list):
            raise TraceError(args.sweep, "not the --json of replayer sweep (grid, rows)")
    trace = load_with_sets(args.target, args.set, allow_missing=args.allow_missing)
    check_worker(trace, spec, args.target)
    note_skipped(trace)
    store_spec(args)
    with engine_runner(spec) as run:
        ex = explain_target(trace, args, run)
    write_atomic(args.output, render_html(ex, str(args.target), trace.header, sweep))
    s = ex.summary()
    print(f"wrote {args.output}: {s['requests']} requests, hit rate {s['hit_rate']:.1%} of "
          f"reachable {s['reachable_rate']:.1%}" + (f", sweep of {len(sweep['rows'])} point(s)"
                                                    if sweep else ""))
    return EXIT_OK

