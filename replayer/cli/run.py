"""`replayer run`: replay one target and print its hits (and, on request, its JSON,
store ops and KV events)."""

from __future__ import annotations

import sys

from replayer.cli.common import (
    EXIT_OK,
    check_outputs,
    check_store_applies,
    check_worker,
    engine_opts,
    load_with_sets,
    note_skipped,
    replay_target,
    set_opt,
    write_output,
)
from replayer.cli.segmented import segment_opts
from traces import TraceError


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="replay a scenario or trace and print its hits")
    run.add_argument("target", help="scenario .yaml or trace directory")
    run.add_argument("--json", metavar="OUT", help="write results as JSON ('-' for stdout)")
    run.add_argument("--store-ops", metavar="OUT.parquet",
                     help="write every store operation as a store_ops table (connector traces)")
    run.add_argument("--kv-events", metavar="OUT.parquet",
                     help="turn vLLM's KV-cache events on and write them as a kv_events table "
                          "(--json then holds their summary)")
    engine_opts(run)
    set_opt(run)
    segment_opts(run, digests=True)


def run(args) -> int:
    from replayer.check.output import SpooledJson, dumps, run_table
    from replayer.replay.engines.sources.specs import parse_spec
    from replayer.replay.execution.clients import engine_runner, runs_in_this_process
    from traces.io.atomic import write_atomic

    from replayer.cli.segmented import check_segment_opts

    spec = parse_spec(args.engine, args.worker)    # a bad spec is reported before anything runs
    check_outputs(args)                    # and an output that cannot be written
    check_segment_opts(args)
    if args.segments > 1:
        return run_segmented(args, spec)
    here = runs_in_this_process(spec)
    # Replayed in this process: its prompts are read batch by batch.
    trace = load_with_sets(args.target, args.set, stream=here,
                           allow_missing=args.allow_missing)
    note_skipped(trace)
    check_worker(trace, spec, args.target)
    if args.store_ops and not trace.engine.connector:
        raise TraceError(args.target, "--store-ops needs a trace with engine.connector")
    check_store_applies(args, [trace])
    if args.kv_events:
        trace.kv_events_wanted = True
    # --json FILE in this process: outcomes spooled as they complete, never all held.
    spool = SpooledJson() if args.json and args.json != "-" and here else None
    with engine_runner(spec) as run:
        result = replay_target(trace, args, run, **({} if spool is None else {"sink": spool}))
    print(run_table(result, shown_of=spool), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.store_ops:
        from traces.model import schema
        from traces.trace import write_table_atomic
        write_table_atomic(args.store_ops, schema.STORE_OPS, result.store["rows"])
    if args.kv_events:
        from traces.model import schema
        from traces.trace import write_table_atomic
        write_table_atomic(args.kv_events, schema.KV_EVENTS, result.kv_events or [])
    if args.json == "-":
        sys.stdout.write(dumps(result))
    elif spool is not None:
        write_atomic(args.json, lambda tmp: spool.write(tmp, result))
        spool.close()
    elif args.json:
        write_atomic(args.json, dumps(result))
    return EXIT_OK



def run_segmented(args, spec) -> int:
    """``run --segments K``: the same outputs, from a replay in time segments."""
    import json

    from replayer.check.output import run_table
    from replayer.cli.common import replay_target
    from replayer.cli.segmented import SegmentedRunner, start_workers_early
    from replayer.replay.execution.clients import engine_runner
    from replayer.replay.segments import warm_up_steps

    start_workers_early(args, spec)
    trace = load_with_sets(args.target, args.set, allow_missing=args.allow_missing)
    note_skipped(trace)
    if args.store_ops and not trace.engine.connector:
        raise TraceError(args.target, "--store-ops needs a trace with engine.connector")
    check_store_applies(args, [trace])
    if args.kv_events:
        trace.kv_events_wanted = True
    warm_up_steps(args.warm_up, trace)        # a bad --warm-up is named before any replay

    def whole(t):
        with engine_runner(spec) as run:
            return replay_target(t, args, run)

    with SegmentedRunner(args, spec, whole) as segmented:
        result = segmented(trace)
    print(run_table(result), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.store_ops:
        from traces.model import schema
        from traces.trace import write_table_atomic
        write_table_atomic(args.store_ops, schema.STORE_OPS, result.store["rows"])
    if args.kv_events:
        from traces.model import schema
        from traces.trace import write_table_atomic
        write_table_atomic(args.kv_events, schema.KV_EVENTS, result.kv_events or [])
    if args.json:
        out = result.as_dict()
        if args.segment_digests:
            out["segments"] = (segmented.reports[0].as_dict() if segmented.reports
                               else None)
        write_output(args.json, json.dumps(out, indent=2) + "\n")
    return EXIT_OK
