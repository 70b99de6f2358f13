"""`replayer anonymize`: token ids replaced by ids derived from chained block hashes."""

from __future__ import annotations

from replayer.cli.common import EXIT_OK, error, force_opt, note_skipped, plan_output, say
from traces import load_target


def add_parser(sub) -> None:
    anon = sub.add_parser("anonymize", help="replace token ids by block-hash-derived tokens")
    anon.add_argument("target", help="trace directory (or scenario)")
    anon.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(anon)
    anon.add_argument("--unit", type=int, help="tokens per hashed chunk (default: the largest "
                                               "that divides every block size, the PMU and the "
                                               "lookahead offset of EAGLE's block hashes)")
    anon.add_argument("--secret", metavar="HEX",
                      help="hash key, for reproducible ids (default: random, never stored)")


def run(args) -> int:
    from replayer.analysis.anonymize import anonymize, default_unit
    from traces.trace import write_trace

    if args.unit is not None and args.unit < 1:
        return error("--unit must be at least 1")
    secret = None
    if args.secret is not None:
        try:
            secret = bytes.fromhex(args.secret)
        except ValueError:
            return error(f"--secret must be hexadecimal, got {args.secret!r}")
        if not 1 <= len(secret) <= 64:
            return error("--secret must be 1 to 64 bytes")
    notes = plan_output(args, [args.target])
    trace = load_target(args.target)
    note_skipped(trace)
    unit = args.unit or default_unit(trace.engine)
    out = write_trace(anonymize(trace, unit=unit, secret=secret), args.output, force=args.force,
                      inputs=(args.target,))
    say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests; tokens replaced by ids of "
          f"{unit}-token chunks)")
    return EXIT_OK

