"""One target on two engines: what differs, and where it started.

:mod:`.outcomes` diffs request outcomes, :mod:`.store` store keys by meaning
(and by rank), :mod:`.bisection` searches releases or commits for the first
engine that differs. It imports ``traces``, :mod:`replayer.replay` and
:mod:`replayer.check`, never the CLI.
"""
