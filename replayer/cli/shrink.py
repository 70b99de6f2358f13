"""`replayer shrink`: its options checked and turned into a property, then the run.

Bad options, an unknown cause or request, an engine that does not run and a
property the input does not have are one line on stderr and exit 2.
"""

from __future__ import annotations

import sys

from replayer.cli.common import ENGINE_HELP, EXIT_OK, error, no_server_opt, worker_opt

EXIT_INTERRUPTED = 130


def add_parser(sub) -> None:
    shr = sub.add_parser("shrink", help="cut a trace down to a small scenario that keeps one "
                                        "property (a loss by cause, or two engines disagreeing)")
    shr.add_argument("target", help="scenario .yaml or trace directory")
    shr.add_argument("-o", "--output", required=True, metavar="SCENARIO.yaml")
    shr.add_argument("--request", metavar="ID", help="the request the property is about")
    shr.add_argument("--lost-by", metavar="CAUSE", help="keep: --request loses tokens to this "
                                                        "cause (replayer explain's causes)")
    shr.add_argument("--at-least", type=int, metavar="N",
                     help="with --lost-by: at least N tokens (default: as many as the input)")
    shr.add_argument("--engine", metavar="SPEC", help="with --lost-by: " + ENGINE_HELP)
    shr.add_argument("--diff", nargs=2, metavar=("ENGINE_A", "ENGINE_B"),
                     help="keep: the two engines disagree (on --request, if given)")
    shr.add_argument("--on", choices=("outcomes", "store"), default="outcomes",
                     help="with --diff: disagree on hits (default) or on store keys/lookups")
    shr.add_argument("--max-probes", type=int, metavar="N", help="stop after N probes")
    shr.add_argument("--timeout", type=float, metavar="SECONDS", help="stop after this long")
    shr.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    worker_opt(shr)
    no_server_opt(shr)
    from replayer.cli.segmented import segment_opts

    segment_opts(shr, ray=False)


def property_of(args):
    """The property the options ask for; ValueError says what is wrong."""
    from replayer.analysis.explain import CAUSES
    from replayer.analysis.shrink.prop import Differ, LostBy

    if (args.lost_by is None) == (args.diff is None):
        raise ValueError("shrink needs exactly one property: --lost-by CAUSE (with --request) "
                         "or --diff ENGINE_A ENGINE_B")
    if args.lost_by is not None:
        if args.request is None:
            raise ValueError("--lost-by needs --request ID")
        if args.lost_by not in CAUSES:
            raise ValueError(f"--lost-by {args.lost_by!r}: not a cause explain knows "
                             f"({', '.join(CAUSES)})")
        if args.at_least is not None and args.at_least < 1:
            raise ValueError("--at-least must be at least 1")
        if args.on != "outcomes":
            raise ValueError("--on applies to --diff")
        return LostBy(str(args.request), args.lost_by, args.at_least, args.engine or "installed")
    if args.engine is not None or args.at_least is not None:
        raise ValueError("--engine and --at-least apply to --lost-by (--diff names its engines)")
    return Differ(args.diff[0], args.diff[1], args.on,
                  None if args.request is None else str(args.request))


def run(args) -> int:
    from replayer.analysis.shrink.driver import ShrinkFailed, shrink

    try:
        prop = property_of(args)
    except ValueError as exc:
        return error(str(exc))
    if args.max_probes is not None and args.max_probes < 1:
        return error("--max-probes must be at least 1")
    if args.timeout is not None and args.timeout <= 0:
        return error("--timeout must be positive")
    from replayer.cli.segmented import check_segment_opts, long_probes_in_segments
    from traces import TraceError

    try:
        check_segment_opts(args)
    except TraceError as exc:
        return error(str(exc))
    try:
        out = shrink(args.target, args.output, prop, max_probes=args.max_probes,
                     timeout=args.timeout, worker=args.worker,
                     wrap=long_probes_in_segments(args))
    except (ShrinkFailed, TraceError) as exc:
        return error(str(exc))
    r, t = out.requests, out.tokens
    print(f"wrote {out.output}: {r[1]} request(s) of {r[0]}, {out.events[1]} event(s) of "
          f"{out.events[0]}, {t[1]} prompt token(s) of {t[0]}; {out.probes} probe(s), "
          f"{out.seconds:.1f} s" + (f" (stopped early: {out.stopped})" if out.stopped else ""))
    sys.stdout.flush()
    return EXIT_INTERRUPTED if out.stopped == "interrupted" else EXIT_OK
