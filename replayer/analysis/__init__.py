"""Why hits were lost, and what would change them.

:mod:`.explain` (reachable vs actual hits by cause, with :mod:`.explain_tables`
for its text and Parquet), :mod:`.sweep` (an explained replay per grid point),
:mod:`.html_report` (the ``report`` page), :mod:`.anonymize`, and
:mod:`.shrink` (a trace down to the smallest scenario keeping one property).
It imports ``traces``, :mod:`replayer.replay`, :mod:`replayer.check` and
:mod:`replayer.compare`, never the CLI.
"""
