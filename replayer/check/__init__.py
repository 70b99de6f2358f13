"""Verdicts: does a replay match what it should?

:mod:`.goldens` compares a replay with a target's goldens (and rewrites them
under ``--update-golden``), :mod:`.recorded` with what a recording recorded
(``check --against recorded``), :mod:`.output` prints run and check results as
text and JSON; ``check --recompute`` holds every hit to a cold recompute
(:mod:`.recompute` runs it, :mod:`.reference` makes the recompute,
:mod:`.divergence` compares the two). It imports ``traces`` and :mod:`replayer.replay`, never the CLI.
"""
