"""A trace in memory, and reading/writing it as a directory of Parquet tables.

Writes are atomic: a trace directory is built under a temporary name beside the
target and renamed into place, so a failure never leaves half a trace.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from traces.goldens.kind import GoldenKind
from traces.goldens.outcomes import KINDS, Goldens, kind_of_file
from traces.io.atomic import write_atomic, write_atomic_many
from traces.io.atomic_dir import output_dir_plan, publish_dir
from traces.io.parts import read_parts
from traces.io.request_stream import RequestLists, open_parquet
from traces.model import schema
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError
from traces.model.limits import MAX_JSON_BYTES, load_json, read_bounded
from traces.model.recording_cut import cut_step, merge_durable
from traces.model.sanity import check_async_scheduling, check_golden_table, check_sized_engine
from traces.model.validate import (
    validate_events,
    validate_header,
    validate_request_batches,
    validate_requests,
    validate_table,
)


@dataclass
class Trace:
    header: dict[str, Any]
    requests: pa.Table
    events: pa.Table | None = None
    outcomes: pa.Table | None = None
    steps: pa.Table | None = None
    store_ops: pa.Table | None = None
    kv_events: pa.Table | None = None      # recorded KV-cache events (schema.KV_EVENTS)
    # engine key (e.g. "vllm==0.33.0", or "*" for any) -> request id -> field -> value
    goldens: Goldens = field(default_factory=dict)
    # engine key -> store golden (see traces.goldens.store); traces with a connector
    store_goldens: dict[str, Any] = field(default_factory=dict)
    # engine key -> KV-event golden (see traces.goldens.events)
    event_goldens: dict[str, Any] = field(default_factory=dict)
    # Collect vLLM's KV-cache events in the replay even with no event goldens
    # (``run --kv-events``); see :attr:`collects_kv_events`.
    kv_events_wanted: bool = False
    # Every hit must give what a cold recompute gives (``expect_recompute: true``
    # in a scenario): checked on the model worker (``check --recompute``).
    expect_recompute: bool = False
    path: Path | None = None
    # Half-written parts of a recorded trace (temporary names a kill left); skipped.
    skipped_parts: list[str] = field(default_factory=list)
    # What reading a recording had to settle (requests still running at its end).
    notes: list[str] = field(default_factory=list)
    # A recording cut short (no clean stop): every table holds every row of the
    # engine steps up to this one, and may lack rows after it. None: whole, or a
    # recording from before schema 2 (which cannot tell). See recording_cut.py.
    cut_step: int | None = None
    # Recorded requests with no finish row: still running when the recording
    # ended (the replay aborts them just after its last step).
    running_at_end: list[str] = field(default_factory=list)
    # A streamed read (``read_trace(stream=True)``): the requests table's list
    # columns, left in its Parquet file and read batch by batch by the replay;
    # ``requests`` then holds its other columns only.
    request_lists: RequestLists | None = None
    # Ask the model worker for the top-K logprobs at every output token and every
    # prompt position after a hit (``check --recompute`` sets it on the replays it
    # compares; -1: the whole vocabulary); None: the forced token's logprob only.
    logprob_topk: int | None = None

    def __post_init__(self) -> None:
        # The header's engine block is always the typed, validated form.
        engine = self.header.get("engine")
        if not isinstance(engine, EngineBlock):
            self.header = {**self.header,
                           "engine": EngineBlock.from_dict(str(self.path or "header"), engine)}

    @property
    def engine(self) -> EngineBlock:
        return self.header["engine"]

    def sized_engine(self) -> EngineBlock:
        """The engine block with ``max_model_len`` and ``num_gpu_blocks`` resolved
        for these requests (:meth:`EngineBlock.sized_for`)."""
        total = pc.add(self.requests["num_prompt_tokens"], self.requests["output_len"])
        return self.engine.sized_for(int(pc.max(total).as_py()))

    @property
    def collects_kv_events(self) -> bool:
        """Whether a replay turns vLLM's KV-cache events on: asked for, pinned by
        goldens, or recorded (``check --against recorded`` compares them)."""
        return self.kv_events_wanted or bool(self.event_goldens) or self.kv_events is not None

    def table(self, name: str) -> pa.Table | None:
        return getattr(self, name)

    def header_json(self) -> str:
        """``header.json`` as written: the engine block as it was given."""
        return header_json(self.header)


def header_json(header: dict[str, Any]) -> str:
    """A header as JSON text, the engine block holding only what was given."""
    engine = header["engine"]
    if isinstance(engine, EngineBlock):
        header = {**header, "engine": engine.to_header()}
    return json.dumps(header, indent=2, sort_keys=True) + "\n"


def _write_table(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, compression="zstd")


def write_trace(trace: Trace, out_dir: str | os.PathLike, *, force: bool = False,
                inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Write ``trace`` to ``out_dir`` atomically (see :mod:`traces.io.atomic_dir`).

    An existing trace there is replaced only with ``force``, a recorded one
    never; ``inputs`` (the files read) are never written over.
    """
    out = Path(out_dir)
    output_dir_plan(out, force, inputs)
    return publish_dir(out, lambda tmp: _fill_trace_dir(trace, tmp))


def _fill_trace_dir(trace: Trace, tmp: Path) -> None:
    if trace.request_lists is not None:
        raise ValueError("a streamed trace (read_trace(stream=True)) is replayed, "
                         "not written: read it whole")
    (tmp / schema.HEADER_FILE).write_text(trace.header_json())
    for name in schema.TABLES:
        table = trace.table(name)
        if table is not None:
            _write_table(tmp / schema.TABLES[name].file, table)
    for kind in KINDS:
        for key, expect in sorted(getattr(trace, kind.attr).items()):
            (tmp / schema.GOLDEN_DIR).mkdir(exist_ok=True)
            _write_table(tmp / schema.GOLDEN_DIR / kind.file(key), kind.to_table(expect, key))


def _replace_file(target: Path, table: pa.Table) -> Path:
    """Write ``table`` under a temporary name beside ``target``, then rename it."""
    return write_atomic(target, lambda tmp: _write_table(tmp, table))


def golden_path(trace_dir: str | os.PathLike, kind: GoldenKind, key: str) -> Path:
    """Where one engine's golden of ``kind`` lives in a trace directory."""
    return Path(trace_dir) / schema.GOLDEN_DIR / kind.file(key)


def write_tables(tables: dict[Path, pa.Table]) -> list[Path]:
    """Replace several tables: all are written before the first is renamed."""
    return write_atomic_many({path: (lambda tmp, t=table: _write_table(tmp, t))
                              for path, table in tables.items()})


def write_table_atomic(path: str | os.PathLike, spec: schema.Table,
                       rows: list[dict[str, Any]]) -> Path:
    """One table from rows, written under a temporary name and renamed."""
    return _replace_file(Path(path), pa.Table.from_pylist(rows, schema=spec.arrow_schema()))


def _read_table(path: Path, spec: schema.Table) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(path, f"not a readable Parquet file ({exc})") from None
    validate_table(path, spec, table)
    return table


def read_header(trace_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(trace_dir) / schema.HEADER_FILE
    if not path.is_file():
        raise TraceError(trace_dir, f"not a trace directory (no {schema.HEADER_FILE})")
    header = load_json(path, read_bounded(path, MAX_JSON_BYTES, "header"))
    return validate_header(path, header)


def _sorted_by_arrival(table: pa.Table | None) -> pa.Table | None:
    """Recorded requests in arrival order (older recordings wrote them as they finished)."""
    if table is None or "arrival_order" not in table.column_names:
        return table
    return table.sort_by([("arrival_order", "ascending")])


def _fold_finishes(root: Path, requests: pa.Table, finishes: pa.Table | None,
                   steps: pa.Table | None, events: pa.Table | None,
                   notes: list[str]) -> tuple[pa.Table, pa.Table | None, list[str]]:
    """Outputs of finished requests into their rows; the rest stopped with the recording.

    A request with no finish row was still running when the recording ended
    (shutdown or kill): it keeps ``output_len`` = its ``max_tokens`` and gets
    an ``abort`` event just after the last recorded step, so the replay stops
    it where the recording stopped. Returns the requests, the events and those ids.
    """
    ids = requests["id"].to_pylist()
    index = {rid: i for i, rid in enumerate(ids)}
    out_len = requests["output_len"].to_pylist()
    out_tok: list[Any] = [None] * len(ids)
    orphans = 0
    if finishes is not None:
        for rid, n, toks in zip(finishes["id"].to_pylist(), finishes["output_len"].to_pylist(),
                                finishes["output_tokens"].to_pylist()):
            i = index.get(rid)
            if i is None:
                orphans += 1
                continue
            out_len[i], out_tok[i] = n, toks
            index[rid] = -1
    if orphans:
        notes.append(f"{root / schema.FINISHES.name}: {orphans} finish row(s) of requests "
                     "whose part was lost; dropped")
    running = [rid for rid, i in index.items() if i >= 0]
    if running:
        # The recording ended after its last step and its last arrival (a kill
        # loses each table's last unflushed rows, not necessarily the same ones).
        last = max(pc.max(steps["step"]).as_py() if steps is not None and steps.num_rows else 0,
                   pc.max(requests["arrival_step"]).as_py() or 0)
        extra = pa.Table.from_pylist(
            [{"after": None, "at_step": last + 1, "action": "abort", "target": rid}
             for rid in running], schema=schema.EVENTS.arrow_schema())
        events = extra if events is None else pa.concat_tables(
            [events, extra.select(events.column_names).cast(events.schema)])
        notes.append(f"{len(running)} request(s) still running when the recording ended: "
                     f"aborted before step {last + 1} in the replay")
    for name, values, typ in (("output_len", out_len, pa.int64()),
                              ("output_tokens", out_tok, pa.list_(pa.int32()))):
        field_ = pa.field(name, typ, nullable=name != "output_len")
        arr = pa.array(values, typ)
        if name in requests.column_names:
            requests = requests.set_column(requests.column_names.index(name), field_, arr)
        else:
            requests = requests.append_column(field_, arr)
    return requests, events, running


def _read_streamed(path: Path, spec: schema.Table) -> tuple[pa.Table, RequestLists | None]:
    """The requests table without its list columns, and where those are; a table
    with no rows or no list columns is read whole (nothing to stream)."""
    pf = open_parquet(path)
    try:
        lists = RequestLists.of_file(path, pf)
        if not lists.names or not lists.num_rows:
            pf.close()
            return _read_table(path, spec), None
        try:
            table = pf.read(columns=[n for n in pf.schema_arrow.names if n not in lists.names])
        except (OSError, pa.ArrowException) as exc:
            raise TraceError(path, f"not a readable Parquet file ({exc})") from None
    finally:
        pf.close()
    validate_table(path, spec, table, file_schema=lists.file_schema)
    return table, lists


def read_trace(trace_dir: str | os.PathLike, *, stream: bool = False) -> Trace:
    """Read and validate a trace directory; errors name file, column and row.

    ``stream``: leave the requests table's list columns (prompts, outputs) in
    its file, read batch by batch when the trace is replayed
    (:mod:`traces.io.request_stream`), so a long trace's replay holds memory for
    its live requests, not for all of them; for a replay only (``run``), other
    readers of ``requests`` need it whole. Validation is the same, errors too.
    A recorded trace (a folder of parts) is read whole either way."""
    root = Path(trace_dir)
    header = read_header(root)
    tables: dict[str, pa.Table | None] = {}
    skipped: list[str] = []
    durable: dict[str, int] = {}
    lists: RequestLists | None = None
    for name, spec in schema.TABLES.items():
        path = root / spec.file
        if path.exists() and (root / spec.name).is_dir():
            raise TraceError(root / spec.name, f"both {spec.file} and a folder of parts; "
                                               "a table is one or the other")
        if (path.exists() and name == "requests" and stream
                and not (root / schema.FINISHES.name).is_dir()):
            tables[name], lists = _read_streamed(path, spec)
        elif path.exists():
            tables[name] = _read_table(path, spec)
        elif (root / spec.name).is_dir():
            # A recorded table: complete parts merged in order (traces.io.parts).
            got = read_parts(root / spec.name, spec, _read_table)
            skipped += got.skipped
            merge_durable(durable, got.durable)
            tables[name] = _sorted_by_arrival(got.table) if name == "requests" else got.table
            if tables[name] is None and spec.required:
                raise TraceError(root / spec.name, "holds no complete part")
        elif spec.required:
            raise TraceError(path, "missing (every trace has a requests table)")
        else:
            tables[name] = None
    notes: list[str] = []
    running: list[str] = []
    if (root / schema.FINISHES.name).is_dir():
        got = read_parts(root / schema.FINISHES.name, schema.FINISHES, _read_table)
        skipped += got.skipped
        merge_durable(durable, got.durable)
        tables["requests"], tables["events"], running = _fold_finishes(
            root, tables["requests"], got.table, tables["steps"], tables["events"], notes)
    goldens: dict[str, dict[str, Any]] = {kind.attr: {} for kind in KINDS}
    gdir = root / schema.GOLDEN_DIR
    if gdir.is_dir():
        for path in sorted(gdir.glob("*.parquet")):
            kind = kind_of_file(path.name)
            table = _read_table(path, kind.table)
            meta = table.schema.metadata or {}
            key = meta.get(b"engine", path.stem.encode()).decode(errors="replace")
            check_golden_table(path, table, key, kind.file(key))
            goldens[kind.attr][key] = kind.from_table(table)
    cut = cut_step(root, durable)
    if cut is not None:
        notes.insert(0, f"the recording was cut short (no clean stop): every table is whole "
                        f"through step {cut}")
    trace = Trace(header=header, **goldens, path=root, request_lists=lists,
                  skipped_parts=skipped, notes=notes, cut_step=cut, running_at_end=running,
                  **tables)  # type: ignore[arg-type]
    validate_trace(root, trace)
    return trace


def validate_trace(root: Path, trace: Trace) -> None:
    """The whole trace checked, each table against its schema and the others
    (errors name the file, column and row)."""
    # A trace built from one source file (scenario, imported trace) names that file.
    def where(name: str) -> Path:
        return root if root.is_file() else root / name

    check_async_scheduling(where(schema.HEADER_FILE), trace.engine,
                           (trace.header.get("source") or {}).get("kind"))
    lists = trace.request_lists
    if lists is None:
        validate_requests(where(schema.REQUESTS.file), trace.header, trace.requests)
    else:                           # a streamed read: the list columns batch by batch
        validate_request_batches(lists.path, trace.header, trace.requests,
                                 set(lists.file_schema.names),
                                 lists.batches(("num_prompt_tokens", "output_len")))
    check_sized_engine(where(schema.HEADER_FILE), trace)
    if trace.events is None and not any(trace.goldens.values()):
        return                      # nothing names a request (a long imported trace)
    ids = set(trace.requests["id"].to_pylist())
    if trace.events is not None:
        validate_events(where(schema.EVENTS.file), trace.events, ids)
    for key, expect in trace.goldens.items():
        for row, rid in enumerate(expect):
            if rid not in ids:
                raise TraceError(root / schema.GOLDEN_DIR, f"golden for unknown request {rid!r} "
                                 f"(engine {key})", column="id", row=row)
