"""One hint, said once: a cold command that spent long starting vLLM names the
warm server (``replayer server start`` or ``PREFIX_REPLAYER_AUTO_SERVER=1``).

Said only to a person (stderr is a terminal), only when no server was opted
out of (``--no-server``, ``PREFIX_REPLAYER_NO_SERVER``), and only once per
cache directory: a marker file there remembers it was said. Scripts, CI logs
and the test suite (stderr is a pipe) never see it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

#: A cold start-up at least this long (vLLM's import and the engine build) earns the hint.
SLOW_START_S = 3.0
MARKER = "said-warm-server-hint"


def marker() -> Path:
    from replayer.replay.engines.sources.releases import cache_dir

    return cache_dir() / MARKER


def warm_server_hint(cold_starts: list[float], stream: TextIO | None = None) -> bool:
    """Say the hint on ``stream`` (stderr) if this command earned it; True if said."""
    from replayer.replay.execution.warm import auto, paths

    stream = stream or sys.stderr
    slowest = max(cold_starts, default=0.0)
    if slowest < SLOW_START_S or not paths.server_wanted() or auto.wanted():
        return False
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return False
    where = marker()
    if where.exists():
        return False
    print(f"replayer: hint: {slowest:.0f} s of this command went to starting vLLM. "
          "`replayer server start` keeps it imported, so later commands replay in under a "
          "second; PREFIX_REPLAYER_AUTO_SERVER=1 starts it on first use (docs/warm-engines.md). "
          "Said once.", file=stream, flush=True)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text("")
    except OSError:
        pass
    return True
