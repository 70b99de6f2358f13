"""Fewer passes of Python's cyclic garbage collector while vLLM is built and the replay runs.

vLLM ``gc.freeze()``s its heap once the engine is built, but every step of the
replay allocates (vLLM's scheduler outputs, requests, token lists) as fast as
it frees. CPython 3.11 starts a young-generation pass once allocations exceed
deallocations by the first threshold (700), and each pass walks every young
object still alive, which by then are many: measured on the first 1,000
conversation requests, ~60 passes cost 0.2-0.45 CPU s at block 16 and ~0.13 s
in the hybrid geometry (1-2% of the loop). With the first threshold at
20,000 they are 1-2 passes and 0.01-0.05 s, peak RSS unchanged.

The same holds while vLLM is imported and its engine built
(:func:`replayer.replay.execution.in_process.engine_here`): the import allocates millions of
objects that all survive, and with Python's thresholds ~2,000 passes, 11 of
them over the whole growing heap, took ~2.4 s of the ~11 s start-up. With the
young threshold raised they are ~150 passes, and with full passes only after
100 passes of the middle generation (not 10) none runs before vLLM's own
``gc.collect()`` ahead of its ``gc.freeze()``: ~1.1 s left, most of it that
collection.

Only when passes run changes, never what is freed by reference counting, so
no replay outcome can change (``tests/test_shortcuts.py`` and
``tests/test_gc_tuning.py`` compare). The thresholds are restored when the
loop ends (the engine is built), so the rest of the process keeps Python's.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

# Thresholds during a build and a replay loop (Python's are 700, 10, 10): the
# young generation's, and the oldest's (full passes after this many passes of
# the middle generation, rather than 10).
REPLAY_GEN0_THRESHOLD = 20_000
REPLAY_GEN2_THRESHOLD = 100


@contextmanager
def fewer_gc_passes() -> Iterator[None]:
    """Raise the young and oldest generations' thresholds inside the block,
    restore them after.

    A threshold already higher is kept, and a switched-off collector (first
    threshold 0) is left alone."""
    before = gc.get_threshold()
    if before[0] != 0:
        gc.set_threshold(max(before[0], REPLAY_GEN0_THRESHOLD), before[1],
                         max(before[2], REPLAY_GEN2_THRESHOLD))
    try:
        yield
    finally:
        gc.set_threshold(*before)
