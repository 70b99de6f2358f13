"""A progress line for long replays: on a terminal only, and only after 2 s."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .replay import Progress


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, delay: float = 2.0,
                 interval: float = 0.2, enabled: bool | None = None) -> None:
        # sys.stderr as it is now, not as it was when this module was imported
        self.stream = stream = stream if stream is not None else sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self.start = time.monotonic()
        self.delay = delay
        self.interval = interval
        self.last = 0.0
        self.shown = False

    def __call__(self, p: Progress) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or (now - self.last < self.interval and p.done < p.total):
            return
        self.last = now
        width = 30
        filled = int(width * p.done / p.total) if p.total else width
        rate = p.cached_tokens / p.prompt_tokens if p.prompt_tokens else 0.0
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {p.done}/{p.total} requests"
                          f"  {p.steps} steps  hit rate {rate:.1%}  {now - self.start:.0f}s ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
