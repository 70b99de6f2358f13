"""A progress line for long replays: on a terminal only, and only after 2 s (a tqdm bar)."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from replayer.replay.loop import Progress


class _Bar(tqdm):
    """tqdm with the replay's own counters (steps, hit rate) as bar_format fields."""

    monitor_interval = 0            # no monitor thread: the bar is redrawn only when called
    steps = 0
    hit_rate = 0.0

    @property
    def format_dict(self):
        return {**super().format_dict, "steps": self.steps, "hit_rate": self.hit_rate}


class ProgressBar:
    """Called with each :class:`~replayer.replay.loop.Progress`; ``close()`` ends the line.
    ``enabled=None``: shown only where ``stream`` is a terminal; nothing is ever
    written to a stream that is not, unless ``enabled=True``."""

    FORMAT = ("[{bar:30}] {n}/{total} requests  {steps} steps  "
              "hit rate {hit_rate:.1%}  {elapsed} ")

    def __init__(self, stream: TextIO | None = None, delay: float = 2.0,
                 interval: float = 0.2, enabled: bool | None = None) -> None:
        # sys.stderr as it is now, not as it was when this module was imported
        stream = stream if stream is not None else sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        # Made now, so its clock and delay start here; it draws nothing before the
        # first call that comes after `delay` (and `interval` after the last drawing).
        # A delay of 0 would make tqdm draw at once, before the total is known.
        self.bar = _Bar(file=stream, disable=not self.enabled, delay=max(delay, 1e-9),
                        mininterval=interval, miniters=0, ascii=".#",
                        bar_format=self.FORMAT, leave=True)
        # A terminal that reports no size (0x0, as a bare pty does) would make tqdm
        # draw nothing: its lines are then written whole, as elsewhere.
        if self.enabled and ((self.bar.ncols or 0) <= 0 or (self.bar.nrows or 0) <= 0):
            self.bar.ncols = self.bar.nrows = None

    def __call__(self, p: Progress) -> None:
        if not self.enabled:
            return
        bar = self.bar
        bar.total = p.total
        bar.steps = p.steps
        bar.hit_rate = p.cached_tokens / p.prompt_tokens if p.prompt_tokens else 0.0
        bar.update(p.done - bar.n)      # drawn if past the delay and the interval

    def close(self) -> None:
        # The final state and a newline, only where the bar was ever drawn.
        self.bar.close()
