"""A replay split into time segments that run at once, each proven exact at its boundary.

:mod:`.plan` places the boundaries (about equal work per segment, warm-up
included) and says when a trace must replay in one piece; :mod:`.worker`
replays one segment and takes the state digest at its boundaries (the digest
itself is vLLM's state read by a per-release module,
:mod:`replayer.replay.engines.digest.release_0_33`); :mod:`.hosts` runs workers in
this process, a local process pool or on Ray; :mod:`.head` proves every
boundary in order and assembles the sequential replay's result.
"""

from replayer.replay.segments.head import SegmentReport, replay_segments
from replayer.replay.segments.plan import (
    DEFAULT_WARM_UP,
    SegmentPlan,
    plan_segments,
    warm_up_steps,
    why_serial,
)

__all__ = ["DEFAULT_WARM_UP", "SegmentPlan", "SegmentReport", "plan_segments",
           "replay_segments", "warm_up_steps", "why_serial"]
