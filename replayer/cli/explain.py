"""`replayer explain`: reachable vs actual hits per request, the lost tokens by cause."""

from __future__ import annotations

from replayer.cli.common import (
    EXIT_OK,
    check_worker,
    engine_opts,
    error,
    explain_target,
    load_with_sets,
    note_skipped,
    set_opt,
    store_spec,
    write_output,
)
from replayer.cli.segmented import segment_opts


def add_parser(sub) -> None:
    exp = sub.add_parser("explain", help="reachable vs actual hits per request, lost tokens "
                                         "by cause (counterfactual replays)")
    exp.add_argument("target", help="scenario .yaml or trace directory")
    exp.add_argument("--json", metavar="OUT",
                     help="write requests and summary as JSON ('-' for stdout)")
    exp.add_argument("--parquet", metavar="OUT", help="write the per-request table as Parquet")
    exp.add_argument("--top", type=int, default=5, help="requests listed by lost tokens (5)")
    engine_opts(exp)
    set_opt(exp)
    segment_opts(exp)


def run(args) -> int:
    from replayer.analysis.explain_tables import render, write_parquet_atomic
    from replayer.cli.segmented import check_segment_opts, start_workers_early
    from replayer.replay.engines.sources.specs import parse_spec
    from replayer.replay.execution.clients import engine_runner

    spec = parse_spec(args.engine, args.worker)
    if args.top < 0:
        return error("--top must be at least 0")
    check_segment_opts(args)
    start_workers_early(args, spec)
    trace = load_with_sets(args.target, args.set, allow_missing=args.allow_missing)
    check_worker(trace, spec, args.target)
    note_skipped(trace)
    store_spec(args)                        # a bad --store is reported before any replay
    with engine_runner(spec) as run:         # one engine process for every counterfactual
        if args.segments > 1:
            ex = explain_segmented(trace, args, spec, run)
        else:
            ex = explain_target(trace, args, run)
    print(render(ex, top=args.top))
    if args.parquet:
        write_parquet_atomic(args.parquet, ex.table)
    write_output(args.json, ex.dumps())
    return EXIT_OK



def explain_segmented(trace, args, spec, run):
    """explain's replays (baseline, then each counterfactual), each in time segments
    on one host kept for them all."""
    from replayer.analysis.explain import explain
    from replayer.cli.common import replay_target
    from replayer.cli.segmented import SegmentedRunner
    from replayer.replay.segments import warm_up_steps

    warm_up_steps(args.warm_up, trace)        # a bad --warm-up is named before any replay
    count = iter(range(1, 1 << 30))
    with SegmentedRunner(args, spec, lambda t: replay_target(t, args, run)) as segmented:
        return explain(trace, run=lambda t: segmented(t, label=f"replay {next(count)}"))
