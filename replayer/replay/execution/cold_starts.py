"""How long each cold replay of this process spent starting its engine.

A leaf both kinds of cold client write to (in this process, a child
process), and the CLI's once-only warm-server hint reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replayer.replay.loop import ReplayResult

#: Seconds each cold replay of this process spent starting its engine (vLLM's
#: import, on a client's first replay, and the engine build): what the CLI's
#: once-only hint about the warm server reads (:mod:`replayer.cli.hints`).
COLD_STARTS: list[float] = []


def note_cold_start(result: ReplayResult) -> ReplayResult:
    """Keep ``result``'s start-up time (a cold client's replay); returns it."""
    seconds = result.timings.get("startup_s")
    if seconds is not None:
        COLD_STARTS.append(float(seconds))
    return result
