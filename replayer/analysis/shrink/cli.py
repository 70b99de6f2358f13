"""``replayer shrink``'s options checked and turned into a property, then the run.

Kept apart from :mod:`replayer.cli.main` so that file only names the command.
Bad options, an unknown cause or request, an engine that does not run and a
property the input does not have are one line on stderr and exit 2.
"""

from __future__ import annotations

import sys
from typing import Callable

EXIT_OK, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 2, 130


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


def run_shrink(args, err: Callable[[str], int]) -> int:
    from replayer.analysis.shrink.driver import ShrinkFailed, shrink

    try:
        prop = property_of(args)
    except ValueError as exc:
        return err(str(exc))
    if args.max_probes is not None and args.max_probes < 1:
        return err("--max-probes must be at least 1")
    if args.timeout is not None and args.timeout <= 0:
        return err("--timeout must be positive")
    try:
        out = shrink(args.target, args.output, prop, max_probes=args.max_probes,
                     timeout=args.timeout)
    except ShrinkFailed as exc:
        return err(str(exc))
    r, t = out.requests, out.tokens
    print(f"wrote {out.output}: {r[1]} request(s) of {r[0]}, {out.events[1]} event(s) of "
          f"{out.events[0]}, {t[1]} prompt token(s) of {t[0]}; {out.probes} probe(s), "
          f"{out.seconds:.1f} s" + (f" (stopped early: {out.stopped})" if out.stopped else ""))
    sys.stdout.flush()
    return EXIT_INTERRUPTED if out.stopped == "interrupted" else EXIT_OK
