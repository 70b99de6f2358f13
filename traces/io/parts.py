"""Crash-safe, bounded-memory writing of recorded tables, and reading them back.

A recorder runs inside a serving engine for hours and may be killed (kill -9,
OOM) at any moment. So rows are buffered in memory up to a bound, and each
flush writes one complete Parquet file, a *part*, under a temporary name,
fsyncs it and renames it into place: under its final name a part is always
whole. A temporary part left behind by a kill is reported by the reader and
skipped, never half-read.

Layout: ``<trace>/<table>/part-r<rank>-<seq>.parquet``, one file set per
process and rank (the scheduler process writes requests, steps, outcomes and
events as rank 0; each worker rank writes its own store_ops parts). A flat
``<table>.parquet`` (authored, imported and compiled traces) still reads as
before; a table is one form or the other, never both.

Flushes run on a background thread so the engine's step never waits on
Parquet encoding or the disk; the hand-off queue holds at most
``MAX_PENDING`` buffers, so memory stays bounded even on a slow disk (the
engine then waits, rather than the recorder growing without limit).

What the engine's thread does per row is kept to the least, because the
writer thread shares its GIL: rows are added to a few long-lived column
lists (no per-row objects survive to burden vLLM's garbage collections:
that cost more than the hooks themselves), a step's rows go in as one
batch (a scalar stands for a column repeated over the batch), and token
lists go in packed (:func:`pack_tokens`, 4 bytes a token, not a tracked
list of Python ints), so the writer thread turns them into Arrow with
numpy. Parquet encoding and compression release the GIL.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.io.atomic_dir import fsync_path
from traces.model import schema
from traces.model.errors import TraceError

# A recorder hands its writers a logger on vLLM's tree (so the server's handler
# formats the line like vLLM's own); this one serves writers used elsewhere.
log = logging.getLogger("prefix_replayer.recorder")


class RecordingError(TraceError):
    """A recorded table could not be written: the recording is incomplete.

    Raised by the next append and by ``close`` (a failed stop), and logged the
    moment it happens, so a full or read-only disk never passes for a whole trace.
    """


PART_RE = re.compile(r"^part-r(\d+)-(\d+)\.parquet$")
TMP_RE = re.compile(r"^\.part-r(\d+)-(\d+)\.parquet\.tmp$")
MAX_PENDING = 2
DEFAULT_MAX_ROWS = 65536
DEFAULT_MAX_WEIGHT = 1_000_000     # list elements (tokens) buffered before a flush
DEFAULT_MAX_SECONDS = 10.0
_SEQUENCES = (list, tuple, type({}.keys()), type({}.values()))
# A recorder writes requests with their tokens as they arrive (outputs go to
# ``finishes``); the imported and anonymised forms (after, arrival_ms,
# prompt_block_ids) stay out of recorded parts.
RECORDED_COLUMNS = {"requests": ("id", "arrival_step", "num_prompt_tokens", "prompt_tokens",
                                 "output_len", "cache_salt", "lora_name", "priority",
                                 "arrival_order", "external_id", "skip_reading_prefix_cache",
                                 "mm_inputs"),
                    # A recorder records one engine: no prefill/decode instance to name.
                    "store_ops": ("order", "step", "rank", "op", "key", "group", "boundary",
                                  "bytes", "result", "request", "loader")}


def pack_tokens(tokens) -> bytes:
    """Token ids as little-endian int32 bytes: what a list<int32> column takes packed.

    ``struct.pack`` reads a list of ints about twice as fast as any Arrow or
    numpy conversion, and the packed form holds a token in 4 bytes rather
    than a Python int's 28 plus the list's pointer.
    """
    return struct.pack(f"<{len(tokens)}i", *tokens)


def part_name(rank: int, seq: int) -> str:
    return f"part-r{rank:03d}-{seq:06d}.parquet"


def parts_on_disk(folder: Path) -> tuple[int, int]:
    """(bytes, parts) of a recorded table's complete parts."""
    parts = [p for p in folder.iterdir() if PART_RE.match(p.name)] if folder.is_dir() else []
    return sum(p.stat().st_size for p in parts), len(parts)


def write_part(folder: Path, table: pa.Table, rank: int, seq: int) -> Path:
    """One complete part: temporary name, fsync, rename, fsync the folder."""
    final = folder / part_name(rank, seq)
    tmp = folder / f".{final.name}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)     # a full disk leaves no half part behind
        raise
    fsync_path(folder)
    return final


class PartWriter:
    """Buffered rows of one table, flushed as whole parts every N rows or T seconds.

    ``append`` (one row) and ``extend`` (a batch of rows, column-wise) add to
    the column lists under a lock; building Arrow arrays, encoding and disk
    writes happen on the writer thread. ``weight`` lets a row count for its
    list lengths (a prompt's tokens), so the buffer is bounded in elements,
    not only rows.
    """

    def __init__(self, trace_dir: str | os.PathLike, spec: schema.Table, rank: int = 0,
                 max_rows: int = DEFAULT_MAX_ROWS, max_weight: int = DEFAULT_MAX_WEIGHT,
                 max_seconds: float = DEFAULT_MAX_SECONDS,
                 columns: tuple[str, ...] | None = None,
                 watermark: Callable[[], int] | None = None,
                 durable_map: Callable[["PartWriter", int], dict[str, int]] | None = None,
                 logger: logging.Logger | None = None) -> None:
        """``watermark``: the engine step through which every row of this table has
        been handed over (read before each swap, so a part holds every row of the
        steps up to it); ``durable_map(writer, part_mark)``: what each table of the
        recording has on disk, written into each part's metadata
        (:data:`schema.PART_DURABLE_KEY`) so a reader of a cut recording knows
        up to which step it is whole."""
        self.spec = spec
        self.rank = rank
        self.folder = Path(trace_dir) / spec.name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordingError(exc.filename or self.folder,
                                 f"cannot record here ({exc.strerror or exc})") from None
        mine = [p for p in self.folder.iterdir()
                if (m := PART_RE.match(p.name) or TMP_RE.match(p.name)) and int(m.group(1)) == rank]
        if mine:
            raise TraceError(self.folder, f"already holds parts of rank {rank} "
                                          "(record each run into a new directory)")
        self.max_rows, self.max_weight, self.max_seconds = max_rows, max_weight, max_seconds
        columns = columns or RECORDED_COLUMNS.get(spec.name)
        self.schema = spec.arrow_schema(set(columns) if columns else None)
        self._cols: dict[str, list[Any]] = {f.name: [] for f in self.schema}
        self._n = 0
        self._weight = 0
        self._since = 0.0
        self._seq = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._watermark, self._durable_map = watermark, durable_map
        self._log = logger or log
        self.durable = -1             # every row of steps <= durable is in a written part
        self._unwritten = 0           # parts handed over, not yet renamed into place
        self._error: BaseException | None = None
        self._closed = False
        self.parts_written = 0
        self.rows_written = 0
        self.cpu_seconds = 0.0        # the writer thread's own CPU time (encoding, disk)
        self.gil_cpu_seconds = 0.0    # of which building Arrow columns (holds the GIL)
        self._thread = threading.Thread(target=self._run, name=f"trace-writer-{spec.name}",
                                        daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------
    def append(self, row: dict[str, Any], weight: int = 1) -> None:
        """One row (a mapping of column to value; absent columns are null).

        A list<int32> column's value may be a list of ints or :func:`pack_tokens` bytes.
        """
        self._add(row, None, 1, weight)

    def extend(self, columns: dict[str, Any], n: int) -> None:
        """``n`` rows given column-wise: each column a list, tuple or dict view of
        ``n`` values, or one value standing for all ``n``; absent columns are null."""
        if n:
            self._add(columns, n, n, n)

    def _add(self, batch: dict[str, Any], n: int | None, rows: int, weight: int) -> None:
        if self._error is not None:
            raise self._error
        with self._lock:
            if not self._n:
                self._since = time.monotonic()
            if n is None:
                for name, col in self._cols.items():
                    col.append(batch.get(name))
            else:
                for name, col in self._cols.items():
                    v = batch.get(name)
                    if type(v) in _SEQUENCES:
                        col += v
                    else:
                        col += [v] * n
            self._n += rows
            self._weight += weight
            full = self._n >= self.max_rows or self._weight >= self.max_weight
        if full:
            self.flush()

    def flush(self) -> None:
        """Hand the buffer to the writer thread (blocks only when MAX_PENDING are queued)."""
        mark = self._watermark() if self._watermark is not None else None   # before the swap
        with self._lock:
            cols, n = self._cols, self._n
            self._cols = {name: [] for name in cols}
            self._n = self._weight = 0
            if n:
                self._unwritten += 1
        if n:
            self._queue.put((cols, mark))

    def durable_now(self, mark: int) -> int:
        """The step through which this table's rows are on disk, given ``mark``,
        the recording's watermark read just before: all of it when nothing is
        buffered or waiting to be written, else what the last written part covers."""
        with self._lock:
            idle = self._n == 0 and self._unwritten == 0
        return mark if idle else self.durable

    def close(self) -> None:
        """Flush what is buffered, wait for every part to be renamed into place."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop the writer thread without a last flush (a session that failed to start)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    # -- writer thread ---------------------------------------------------
    def _run(self) -> None:
        tick = max(0.05, min(1.0, self.max_seconds / 4))
        while True:
            try:
                cols = self._queue.get(timeout=tick)
            except queue.Empty:
                with self._lock:
                    stale = self._n and time.monotonic() - self._since >= self.max_seconds
                if stale:
                    self.flush()
                continue
            if cols is None:
                return
            cols, mark = cols
            if self._error is not None:
                with self._lock:
                    self._unwritten -= 1
                continue            # after a failed part, no later part: no silent gap
            t = time.thread_time()
            try:
                table = pa.Table.from_arrays([_array(cols[f.name], f.type) for f in self.schema],
                                             schema=self.schema)
                if mark is not None and self._durable_map is not None:
                    durable = {**self._durable_map(self, mark), self.spec.name: mark}
                    table = table.replace_schema_metadata(
                        {schema.PART_DURABLE_KEY: json.dumps(durable, sort_keys=True)})
                self.gil_cpu_seconds += time.thread_time() - t
                write_part(self.folder, table, self.rank, self._seq)
                self._seq += 1
                self.parts_written += 1
                self.rows_written += table.num_rows
                if mark is not None:
                    self.durable = max(self.durable, mark)
            except BaseException as exc:  # noqa: BLE001 - raised on the engine's next append
                self._fail(exc)
            finally:
                with self._lock:
                    self._unwritten -= 1
            self.cpu_seconds += time.thread_time() - t

    def _fail(self, exc: BaseException) -> None:
        """Keep the error for the engine's thread, and say it in the log now."""
        text = str(exc).strip()
        reason = getattr(exc, "strerror", None) or (text.splitlines()[0] if text
                                                    else type(exc).__name__)
        where = getattr(exc, "filename", None) or self.folder / part_name(self.rank, self._seq)
        self._error = RecordingError(where, f"writing a part of the {self.spec.name} table "
                                            f"failed ({reason}); the recording is incomplete")
        self._log.error("prefix-replayer recorder: %s", self._error)


def _array(values: list[Any], typ: pa.DataType) -> pa.Array:
    """Arrow array of a column; packed token bytes become a list array through numpy."""
    if not (pa.types.is_list(typ) and typ.value_type == pa.int32()
            and any(isinstance(v, bytes) for v in values)):
        return pa.array(values, typ)
    packed = [v if v is None or isinstance(v, bytes) else pack_tokens(v) for v in values]
    lengths = np.fromiter((0 if v is None else len(v) >> 2 for v in packed), np.int32,
                          count=len(packed))
    offsets = np.zeros(len(packed) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.frombuffer(b"".join(v for v in packed if v is not None), "<i4")
    mask = None
    if any(v is None for v in packed):
        mask = pa.array([v is None for v in packed])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()), typ,
                                    mask=mask)


@dataclass
class PartsRead:
    table: pa.Table | None
    parts: int
    skipped: list[str]        # temporary (half-written) parts, by path
    # table -> the latest step through which its rows were on disk, as the parts
    # say (schema.PART_DURABLE_KEY); empty for parts written before schema 2
    durable: dict[str, int]


def read_parts(folder: Path, spec: schema.Table, read_one) -> PartsRead:
    """Every complete part of a table folder, in (rank, seq) order, as one table.

    ``read_one(path, spec)`` reads and validates one file (so its errors name
    the part). Temporary parts are listed in ``skipped``; anything else in
    the folder is an error, so a stray file is never mistaken for data.
    """
    parts: list[tuple[int, int, Path]] = []
    skipped: list[str] = []
    for p in sorted(folder.iterdir()):
        m = PART_RE.match(p.name)
        if m:
            parts.append((int(m.group(1)), int(m.group(2)), p))
        elif TMP_RE.match(p.name):
            skipped.append(str(p))
        else:
            raise TraceError(p, f"not a part of the {spec.name} table "
                                "(expected part-r<rank>-<seq>.parquet)")
    parts.sort()
    tables = [read_one(p, spec) for _, _, p in parts]
    durable: dict[str, int] = {}
    for (_, _, p), t in zip(parts, tables):
        for name, step in _durable_of(p, t).items():
            durable[name] = max(step, durable.get(name, step))
    if not tables:
        return PartsRead(None, 0, skipped, durable)
    names = set().union(*(t.column_names for t in tables))
    target = spec.arrow_schema(names)
    merged = pa.concat_tables([_conform(t, target) for t in tables])
    return PartsRead(merged, len(tables), skipped, durable)


def _durable_of(path: Path, table: pa.Table) -> dict[str, int]:
    """A part's own account of what was on disk when it was written."""
    raw = (table.schema.metadata or {}).get(schema.PART_DURABLE_KEY)
    if raw is None:
        return {}
    try:
        got = json.loads(raw)
        if not isinstance(got, dict) or not all(isinstance(k, str) and type(v) is int
                                                for k, v in got.items()):
            raise ValueError("not a {table: step} object")
    except ValueError as exc:
        raise TraceError(path, f"unreadable {schema.PART_DURABLE_KEY.decode()} metadata "
                               f"({exc})") from None
    return got


def _conform(table: pa.Table, target: pa.Schema) -> pa.Table:
    """Add missing optional columns as nulls and order columns as the schema does."""
    cols = []
    for f in target:
        if f.name in table.column_names:
            cols.append(table[f.name])
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=target)


def close_all(writers) -> None:
    """Close every writer, then raise the first failure (no table misses its flush)."""
    first: BaseException | None = None
    for w in writers:
        try:
            w.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first
