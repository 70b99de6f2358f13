"""`replayer diff`: one target on two engines, and what differs."""

from __future__ import annotations

import json
import sys

from replayer.cli.common import (
    ENGINE_HELP,
    EXIT_MISMATCH,
    EXIT_OK,
    check_outputs,
    check_store_applies,
    check_worker,
    engine_opts,
    error,
    replay_target,
    write_output,
)
from traces import load_target


def add_parser(sub) -> None:
    diff = sub.add_parser("diff", help="replay a target on two engines; print what differs")
    diff.add_argument("target", help="scenario .yaml or trace directory")
    diff.add_argument("--engine", action="append", required=True, metavar="SPEC",
                      help="give it twice: engine A, then engine B (" + ENGINE_HELP + ")")
    diff.add_argument("--json", metavar="OUT",
                      help="write the differences as JSON ('-' for stdout)")
    diff.add_argument("--worker", action="append", choices=("null", "model"),
                      help="once for both engines or twice (A, then B): null (default) or "
                           "model, as for run (null vs model on one engine holds the real "
                           "worker to the null executor)")
    engine_opts(diff, engine=False)


def run(args) -> int:
    from replayer.compare.outcomes import compare_results, diff_table
    from replayer.replay.engines.sources.specs import parse_spec
    from replayer.replay.execution.clients import engine_runner

    if len(args.engine) != 2:
        return error(f"diff takes exactly two --engine options (A, then B), got {len(args.engine)}")
    workers = args.worker or ["null"]
    if len(workers) not in (1, 2):
        return error(f"diff takes one or two --worker options, got {len(workers)}")
    workers = workers * (3 - len(workers))
    specs = [parse_spec(e, w) for e, w in zip(args.engine, workers)]
    check_outputs(args)
    trace = load_target(args.target)
    for spec in specs:
        check_worker(trace, spec, args.target)
    check_store_applies(args, [trace])
    results = []
    for spec in specs:
        with engine_runner(spec) as run:
            results.append(replay_target(trace, args, run))
    d = compare_results(*results)
    print(diff_table(d), file=sys.stderr if args.json == "-" else sys.stdout)
    write_output(args.json, json.dumps(d.as_dict(), indent=2) + "\n")
    return EXIT_OK if d.identical else EXIT_MISMATCH

