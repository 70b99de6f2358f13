"""Where a recording that was cut short stops being whole.

A recorder killed with ``kill -9`` (or stopped by a failed write) loses each
table's last unflushed rows, and each table flushes on its own clock: the
requests table may end at step 900 while the outcomes go on to 950. Every
recorded part says, for each table of the recording, the engine step through
which that table's rows were on disk when the part was written
(:data:`schema.PART_DURABLE_KEY`, written by :mod:`traces.io.parts`); a
recording that stopped cleanly leaves :data:`schema.END_FILE`. So the step
through which *every* table is whole is the least, over the tables, of the
latest step each was on disk through: up to it the recording is exact, past
it rows may be missing.
"""

from __future__ import annotations

from pathlib import Path

from traces.model import schema


def cut_step(root: Path, durable: dict[str, int]) -> int | None:
    """The step through which every table of the recording at ``root`` is whole,
    or None when it is whole to its end (it stopped cleanly) or cannot tell
    (written before schema 2: no part carries the metadata)."""
    if (root / schema.END_FILE).exists() or not durable:
        return None
    return min(durable.values())


def merge_durable(into: dict[str, int], more: dict[str, int]) -> None:
    """Each table's latest step on disk, over parts read one table at a time."""
    for name, step in more.items():
        into[name] = max(step, into.get(name, step))
