"""`replayer bisect`: the first release or commit whose outcome differs from a good one."""

from __future__ import annotations

from replayer.cli.common import (
    EXIT_MISMATCH,
    EXIT_OK,
    check_store_applies,
    engine_opts,
    error,
    replay_target,
)
from traces import load_target


def add_parser(sub) -> None:
    bis = sub.add_parser("bisect", help="find the first engine whose outcome differs from a "
                                        "good one")
    bis.add_argument("target", help="scenario .yaml or trace directory")
    bis.add_argument("--good", required=True, metavar="SPEC|COMMIT",
                     help="the reference: vllm==X.Y.Z, or a commit with --tree")
    bis.add_argument("--bad", required=True, metavar="SPEC|COMMIT",
                     help="an engine that differs: vllm==X.Y.Z, or a commit with --tree")
    bis.add_argument("--tree", metavar="PATH",
                     help="bisect over the commits of this vLLM git checkout")
    bis.add_argument("--on", choices=("any", "outcomes", "store"), default="any",
                     help="what must differ from good: any (default), outcomes (cached "
                          "tokens), store (keys written, lookups; connector traces)")
    engine_opts(bis, engine=False)


def run(args) -> int:
    """Prints the header first and each replay as it ends (each takes 10-35 s)."""
    from replayer.compare.bisection import (
        CommitLine,
        conclusion,
        header_line,
        probe_line,
        release_line,
        search,
    )
    from replayer.replay.execution.clients import engine_runner

    def say(text: str) -> None:
        print(text, flush=True)

    trace = load_target(args.target)
    check_store_applies(args, [trace])
    if args.on == "store" and not trace.engine.connector:
        return error(f"{args.target}: bisect --on store needs a trace with a connector "
                    "(engine.connector)")

    def replay_on(spec):
        with engine_runner(spec) as run:        # each engine's process ends with its replay
            return replay_target(trace, args, run)

    if args.tree is None:
        line = release_line(args.good, args.bad)
        say(header_line(len(line), "releases"))
        res = search(line, replay_on, on_probe=lambda p: say(probe_line(p)), on=args.on)
    else:
        commits = CommitLine(args.tree, args.good, args.bad)
        try:
            say(header_line(len(commits.commits), f"commits of {commits.tree}"))
            res = search(commits.commits, lambda c: replay_on(commits.engine(c)),
                         on_probe=lambda p: say(probe_line(p)), on=args.on)
        finally:
            commits.close()
    say(conclusion(res))
    return EXIT_OK if res.first_bad is not None else EXIT_MISMATCH

