"""`replayer compile`: a scenario written out as a trace directory."""

from __future__ import annotations

from replayer.cli.common import EXIT_OK, force_opt, plan_output, say


def add_parser(sub) -> None:
    comp = sub.add_parser("compile", help="compile a scenario into a trace directory")
    comp.add_argument("scenario")
    comp.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(comp)


def run(args) -> int:
    from traces.trace import write_trace
    from traces.scenarios.compile import compile_scenario

    notes = plan_output(args, [args.scenario])
    trace = compile_scenario(args.scenario)
    out = write_trace(trace, args.output, force=args.force, inputs=(args.scenario,))
    say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests)")
    return EXIT_OK

