"""``python -m replayer`` and the ``replayer`` command.

A command that replays re-executes itself under the pinned interpreter hash
seed (:mod:`replayer.replay.execution.determinism`) before anything heavy is
imported, so the second interpreter is the only one that pays for pyarrow
and the CLI; every other command goes straight to :func:`replayer.cli.main.main`.
"""

import sys

from replayer.cli import REPLAY_COMMANDS


def entry() -> None:
    argv = sys.argv[1:]
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in REPLAY_COMMANDS:
        from replayer.replay.execution.determinism import reexec_with_pinned_seed

        reexec_with_pinned_seed(argv)
    from replayer.cli.main import main

    sys.exit(main())


if __name__ == "__main__":
    entry()
