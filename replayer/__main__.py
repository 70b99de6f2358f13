"""``python -m replayer`` and the ``replayer`` command.

A command that replays re-executes itself under the pinned interpreter hash
seed (:mod:`replayer.execution.determinism`) before anything heavy is
imported, so the second interpreter is the only one that pays for pyarrow
and the CLI; every other command goes straight to :func:`replayer.cli.main`.
"""

import sys

REPLAY_COMMANDS = ("run", "check", "explain", "sweep", "report", "diff", "bisect", "shrink")


def entry() -> None:
    argv = sys.argv[1:]
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in REPLAY_COMMANDS:
        from replayer.execution.determinism import reexec_with_pinned_seed

        reexec_with_pinned_seed(argv)
    from replayer.cli import main

    sys.exit(main())


if __name__ == "__main__":
    entry()
