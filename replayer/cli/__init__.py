"""The ``replayer`` command: one module per command, each an ``add_parser``
and a ``run``, put together in :mod:`.main`. The only package that prints
for a user and sets exit codes; everything it calls is importable without it.
Kept light: :mod:`replayer.__main__` reads :data:`REPLAY_COMMANDS` before any
heavy import.
"""

REPLAY_COMMANDS = ("run", "check", "explain", "sweep", "report", "diff", "bisect", "shrink")
