"""The requests table's list columns read batch by batch, for a replay in bounded memory.

A day of traffic's requests table is mostly its prompt lists (hash ids or
tokens): read whole, ``pyarrow.parquet.read_table`` peaks ~220 MB above the
interpreter for 288,744 requests. ``read_trace(dir, stream=True)`` keeps the
small scalar columns whole (``Trace.requests``) and leaves the lists in the
file: :class:`RequestLists` reads them with pyarrow's
``ParquetFile.iter_batches`` (batches of rows within a row group, which
polars' readers do not hand out one at a time), once to validate and once
per replay through a :class:`ListWindow`, which holds only the batches whose
rows have not yet been handed to the engine. Rows come in arrival order in
an imported trace, so that is about one batch; a row that arrives late (an
``after:`` follower, an out-of-order ``arrival_step``) keeps only itself once
its batch is passed (the batch is compacted to its unreleased rows).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.model.errors import TraceError

LIST_COLUMNS = ("prompt_tokens", "prompt_block_ids", "output_tokens")
# Bytes of list values per batch (decoded), and the bounds on its rows.
BATCH_BYTES = 4 << 20
MIN_BATCH_ROWS, MAX_BATCH_ROWS = 64, 8192


def _unreadable(path: Path, exc: Exception) -> TraceError:
    return TraceError(path, f"not a readable Parquet file ({exc})")


def open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (OSError, pa.ArrowException) as exc:
        raise _unreadable(path, exc) from None


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of ``path``; None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def list_arrays(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, values, validity) of a list array, as numpy (offsets index values)."""
    return (arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False),
            arr.is_valid().to_numpy(zero_copy_only=False))


class RequestLists:
    """The list columns of one requests Parquet file, read in batches of rows.

    Holds no open file (a trace is pickled to an engine's child process)."""

    def __init__(self, path: Path, file_schema: pa.Schema, num_rows: int,
                 batch_rows: int) -> None:
        self.path = Path(path)
        # The file as validated: a replay reads it again, and must read the same.
        self.stamp = _stamp(self.path)
        self.file_schema = file_schema
        self.names = tuple(n for n in file_schema.names if n in LIST_COLUMNS)
        self.num_rows = num_rows
        self.batch_rows = batch_rows

    @classmethod
    def of_file(cls, path: Path, pf: pq.ParquetFile) -> "RequestLists":
        """Batches sized to ~:data:`BATCH_BYTES` of decoded list values."""
        meta = pf.metadata
        leaves = [c for c in range(meta.num_columns)      # Parquet leaf columns of the lists
                  if pf.schema.column(c).path.split(".")[0] in LIST_COLUMNS]
        size = sum(meta.row_group(g).column(c).total_uncompressed_size
                   for g in range(meta.num_row_groups) for c in leaves)
        per_row = size / max(1, meta.num_rows)
        rows = int(BATCH_BYTES / per_row) if per_row else MAX_BATCH_ROWS
        return cls(path, pf.schema_arrow, meta.num_rows,
                   max(MIN_BATCH_ROWS, min(MAX_BATCH_ROWS, rows)))

    def batches(self, extra: tuple[str, ...] = ()) -> Iterator[tuple[int, pa.Table]]:
        """(first row, rows) of the list columns and ``extra`` columns, in row order."""
        if _stamp(self.path) != self.stamp:
            raise TraceError(self.path, "changed since the trace was read and validated; "
                                        "read it again")
        pf = open_parquet(self.path)
        it = pf.iter_batches(batch_size=self.batch_rows, columns=[*self.names, *extra])
        first = 0
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except (OSError, pa.ArrowException) as exc:
                    raise _unreadable(self.path, exc) from None
                yield first, pa.Table.from_batches([batch])
                first += batch.num_rows
        finally:
            pf.close()
        if first != self.num_rows:
            raise TraceError(self.path, f"holds {first} rows, not the {self.num_rows} read "
                                        "before (changed while replaying?)")

    def window(self) -> "ListWindow":
        return ListWindow(self)


class _Chunk:
    """Rows of one batch not yet handed on, with their list columns as numpy."""

    def __init__(self, rows: np.ndarray, table: pa.Table) -> None:
        self.rows = rows                                   # global row numbers, ascending
        self.table = table
        self.cols = {name: list_arrays(table[name].combine_chunks())
                     for name in table.column_names}
        self.released = np.zeros(len(rows), dtype=bool)
        self.left = len(rows)

    def index(self, row: int) -> int | None:
        j = int(np.searchsorted(self.rows, row))
        return j if j < len(self.rows) and self.rows[j] == row and not self.released[j] else None

    def compacted(self) -> "_Chunk":
        keep = np.flatnonzero(~self.released)
        return _Chunk(self.rows[keep], self.table.take(pa.array(keep)))


class ListWindow:
    """One pass over a :class:`RequestLists` for a replay: :meth:`get` a row's lists
    (reading forward as far as needed), :meth:`release` it once the engine has
    it. Memory follows the rows read but not yet released."""

    def __init__(self, lists: RequestLists) -> None:
        self.lists = lists
        self._batches: Iterator[tuple[int, pa.Table]] | None = None
        self._read = 0                        # rows read from the file so far
        self._starts: list[int] = []          # first row of each chunk, ascending
        self._chunks: list[_Chunk] = []

    def _read_next(self) -> None:
        if self._batches is None:
            self._batches = self.lists.batches()
        first, table = next(self._batches)
        for k, chunk in enumerate(self._chunks):           # passed: keep only what is left
            if 2 * chunk.left <= len(chunk.rows):
                self._chunks[k] = chunk.compacted()
        self._starts.append(first)
        self._chunks.append(_Chunk(np.arange(first, first + table.num_rows), table))
        self._read = first + table.num_rows

    def _find(self, row: int) -> tuple[int, int]:
        if not 0 <= row < self.lists.num_rows:
            raise IndexError(row)
        while row >= self._read:
            self._read_next()
        k = bisect.bisect_right(self._starts, row) - 1
        j = self._chunks[k].index(row) if k >= 0 else None
        if j is None:
            raise LookupError(f"row {row} of {self.lists.path} was released already")
        return k, j

    def get(self, name: str, row: int) -> np.ndarray | None:
        """Row ``row``'s values of list column ``name``; None if absent or null."""
        if name not in self.lists.names:
            return None
        k, j = self._find(row)
        off, vals, valid = self._chunks[k].cols[name]
        return vals[off[j]:off[j + 1]] if valid[j] else None

    def release(self, row: int) -> None:
        """The engine has row ``row``'s request: its lists are not read again."""
        k, j = self._find(row)
        chunk = self._chunks[k]
        chunk.released[j] = True
        chunk.left -= 1
        if not chunk.left:
            del self._chunks[k], self._starts[k]

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
