"""``replayer shrink``: cut a trace down to a small scenario that keeps one property.

A miss found in a 500-request trace is hard to read and slow to replay; the
same miss in two requests of a few thousand tokens is a regression test.
Every probe is a real replay. Modules, one job each:

* :mod:`.case`: the trace as editable requests (tokens in hand), back to a trace;
* :mod:`.prop`: the property (``--lost-by``, ``--diff``) and the probe budget;
* :mod:`.search`: deterministic parallel searches (ddmin, largest passing cut);
* :mod:`.prompts`, :mod:`.engine`: the prompt and engine stages;
* :mod:`.writer`: the scenario YAML, prompts as spans over named streams;
* :mod:`.driver`: the stages in order, progress, limits, the written output.
"""

from replayer.analysis.shrink.driver import ShrinkFailed, shrink

__all__ = ["ShrinkFailed", "shrink"]
