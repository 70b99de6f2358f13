"""Where a recording goes, and the per-process state shared by its hooks.

One :class:`SchedulerSession` per scheduler process writes requests, steps,
outcomes and events as rank 0, and the header; one :class:`StoreSession` per
worker rank writes that rank's store_ops. When scheduler and worker share a
process (uniproc executor, the CPU replay) the store recorder asks the
scheduler session which token boundary and first request a key's block hash
belongs to; otherwise those two columns stay null.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path
from typing import Any

from replayer.recorder.releases import RECORD_ENV, check_release, log  # noqa: F401 (re-exported)
from traces.io.atomic import write_atomic
from traces.io.parts import PartWriter, RecordingError, close_all
from traces.model import schema
from traces.trace import header_json

# Seconds a row may wait in memory before its part is written: what a kill
# can lose (default traces.io.parts.DEFAULT_MAX_SECONDS).
FLUSH_ENV = "PREFIX_REPLAYER_RECORD_FLUSH_SECONDS"
CONFIG_KEY = "recorder_dir"
# Block hash -> (boundary, request) entries kept for the store's boundary
# column; past this many, keys of new prefixes record a null boundary.
MAX_BOUNDARIES = 1 << 18

_LOCK = threading.Lock()
_SCHEDULERS: dict[str, "SchedulerSession"] = {}


def record_dir(vllm_config: Any = None) -> str | None:
    """The output directory: the connector's extra config, else the environment."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    return extra.get(CONFIG_KEY) or os.environ.get(RECORD_ENV) or None


def writer_options() -> dict[str, Any]:
    raw = os.environ.get(FLUSH_ENV)
    if not raw:
        return {}
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{FLUSH_ENV}={raw!r}: expected seconds, e.g. 2.5") from None
    if not seconds > 0:
        raise ValueError(f"{FLUSH_ENV}={raw!r}: must be above 0")
    return {"max_seconds": seconds}


def write_header(out: Path, header: dict[str, Any]) -> None:
    try:
        write_atomic(out / schema.HEADER_FILE, header_json(header))
    except OSError as exc:
        raise RecordingError(exc.filename or out / schema.HEADER_FILE,
                             f"cannot write the header ({exc.strerror or exc})") from None


def check_new_recording(out: Path) -> None:
    """The directory must be new or empty: a recording never lands on another one.

    Worker ranks may have made ``store_ops/`` already (they start first); the
    scheduler's session, the one per recording, checks everything else.
    """
    try:
        entries = [p.name for p in out.iterdir()] if out.exists() else []
    except OSError as exc:
        raise RecordingError(out, f"cannot record here ({exc.strerror or exc})") from None
    if out.exists() and not out.is_dir():
        raise RecordingError(out, "is a file; record into a new, empty directory")
    other = sorted(n for n in entries if n != schema.STORE_OPS.name)
    if other:
        raise RecordingError(out, f"is not empty (holds {', '.join(other[:4])}"
                                  f"{', ...' if len(other) > 4 else ''}); record each run into "
                                  "a new, empty directory")


class SchedulerSession:
    """The scheduler process's tables and step clock."""

    def __init__(self, out: str, **writer_opts: Any) -> None:
        self.out = Path(out)
        self._writer_opts = {**writer_options(), "watermark": self._watermark,
                             "durable_map": self._durable_map, "logger": log, **writer_opts}
        check_new_recording(self.out)
        tables = [schema.TABLES[name] for name in ("requests", "steps", "outcomes", "events")]
        self.writers: dict[str, PartWriter] = {}
        # The last step whose update the recorder has seen through: every row of
        # every table for steps up to it has been handed to its writer.
        self.done_step = -1
        try:
            for t in tables + [schema.FINISHES]:
                self.writers[t.name] = PartWriter(self.out, t, 0, **self._writer_opts)
        except BaseException:
            for w in self.writers.values():
                w.abandon()
            raise
        self.step = 0
        self.hash_block_size = 1
        self.boundaries: dict[str, tuple[int, str]] | None = None   # on with a connector
        with _LOCK:
            _SCHEDULERS[str(self.out.resolve())] = self
        atexit.register(self.close)
        self._closed = False
        log.info("prefix-replayer recorder: recording to %s", self.out.resolve())

    def add_table(self, table: schema.Table) -> PartWriter:
        """A table only some recordings have (``kv_events``), written like the others."""
        writer = PartWriter(self.out, table, 0, **self._writer_opts)
        self.writers[table.name] = writer
        return writer

    def _watermark(self) -> int:
        return self.done_step

    def _durable_map(self, writer: PartWriter, mark: int) -> dict[str, int]:
        """Each table's step on disk, for the metadata of ``writer``'s next part
        (the watermark read first: a row handed over after it is for a later step)."""
        now = self.done_step
        return {name: w.durable_now(now) for name, w in list(self.writers.items())
                if w is not writer}

    def add_boundaries(self, request_id: str, block_hashes, start: int = 0) -> None:
        """File ``block_hashes[start:]`` of ``request_id`` under their token
        boundaries (a store key names a block hash; its row names the boundary and
        the first request that held that prefix)."""
        b = self.boundaries
        if b is None or len(b) >= MAX_BOUNDARIES:
            return
        hbs = self.hash_block_size
        for i in range(start, len(block_hashes)):
            b.setdefault(bytes(block_hashes[i]).hex(), ((i + 1) * hbs, request_id))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close_all(self.writers.values())    # every table gets its last flush
            # Last, once every table is whole: a reader finding it knows the
            # recording was not cut short (traces/model/recording_cut.py).
            try:
                write_atomic(self.out / schema.END_FILE,
                             json.dumps({"stopped_at_step": self.step}) + "\n")
            except OSError as exc:
                raise RecordingError(self.out / schema.END_FILE, "cannot mark the recording "
                                     f"whole ({exc.strerror or exc})") from None
        finally:
            with _LOCK:
                _SCHEDULERS.pop(str(self.out.resolve()), None)
        parts = sum(1 for _ in self.out.glob("*/*.parquet"))
        log.info("prefix-replayer recorder: stopped at step %d; %d part(s) in %s",
                 self.step, parts, self.out.resolve())


def scheduler_session(out: str) -> SchedulerSession | None:
    with _LOCK:
        return _SCHEDULERS.get(str(Path(out).resolve()))


class StoreSession:
    """One worker rank's store_ops parts."""

    def __init__(self, out: str, rank: int, **writer_opts: Any) -> None:
        self.out = out
        writer_opts = {**writer_options(), **writer_opts}
        if (Path(out) / schema.HEADER_FILE).exists():   # workers start before the scheduler
            raise RecordingError(out, "already holds a recording (header.json); record each "
                                      "run into a new, empty directory")
        self.writer = PartWriter(out, schema.STORE_OPS, rank, logger=log, **writer_opts)
        atexit.register(self.close)

    def close(self) -> None:
        self.writer.close()
