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
import os
import threading
from pathlib import Path
from typing import Any

from traces import schema
from traces.atomic import write_atomic
from traces.trace import header_json
from traces.writer import PartWriter

from .releases import RECORD_ENV, RECORDER_RELEASES, check_release  # noqa: F401 (re-exported)

# Seconds a row may wait in memory before its part is written: what a kill
# can lose (default traces.writer.DEFAULT_MAX_SECONDS).
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
    write_atomic(out / schema.HEADER_FILE, header_json(header))


class SchedulerSession:
    """The scheduler process's tables and step clock."""

    def __init__(self, out: str, **writer_opts: Any) -> None:
        self.out = Path(out)
        writer_opts = {**writer_options(), **writer_opts}
        tables = [schema.TABLES[name] for name in ("requests", "steps", "outcomes", "events")]
        self.writers = {t.name: PartWriter(self.out, t, 0, **writer_opts)
                        for t in tables + [schema.FINISHES]}
        self.step = 0
        self.hash_block_size = 1
        self.boundaries: dict[str, tuple[int, str]] | None = None   # on with a connector
        with _LOCK:
            _SCHEDULERS[str(self.out.resolve())] = self
        atexit.register(self.close)
        self._closed = False

    def add_boundaries(self, request_id: str, block_hashes) -> None:
        b = self.boundaries
        if b is None or len(b) >= MAX_BOUNDARIES:
            return
        hbs = self.hash_block_size
        for i, h in enumerate(block_hashes):
            b.setdefault(bytes(h).hex(), ((i + 1) * hbs, request_id))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self.writers.values():
            w.close()
        with _LOCK:
            _SCHEDULERS.pop(str(self.out.resolve()), None)


def scheduler_session(out: str) -> SchedulerSession | None:
    with _LOCK:
        return _SCHEDULERS.get(str(Path(out).resolve()))


class StoreSession:
    """One worker rank's store_ops parts."""

    def __init__(self, out: str, rank: int, **writer_opts: Any) -> None:
        self.out = out
        writer_opts = {**writer_options(), **writer_opts}
        self.writer = PartWriter(out, schema.STORE_OPS, rank, **writer_opts)
        atexit.register(self.close)

    def close(self) -> None:
        self.writer.close()
