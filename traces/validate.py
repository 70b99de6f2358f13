"""Validation of a trace: every message names the file, and the column and row.

Checks run on Arrow columns (vectorised where the trace can be large), so
validating the whole conversation trace costs milliseconds, not seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import schema
from .engine_spec import EngineBlock
from .errors import TraceError
from .events import check_event_row
from .sanity import (check_async_scheduling, check_header_bounds, check_request_bounds,
                     check_sized_engine)

if TYPE_CHECKING:
    from .trace import Trace

SOURCE_KINDS = ("authored", "imported", "recorded")


def validate_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise TraceError(path, "header must be a JSON object")
    version = header.get("schema_version")
    if version != schema.SCHEMA_VERSION:
        raise TraceError(path, f"unknown schema version {version!r} "
                               f"(this replayer reads version {schema.SCHEMA_VERSION})")
    if "engine" not in header:
        raise TraceError(path, "header has no 'engine' block")
    header = dict(header)
    header["engine"] = EngineBlock.from_dict(str(path), header["engine"])
    source = header.get("source", {})
    if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
        raise TraceError(path, f"header.source.kind must be one of {', '.join(SOURCE_KINDS)}")
    prompt = header.get("prompt_blocks")
    if prompt is not None and (not isinstance(prompt, dict)
                               or not isinstance(prompt.get("block_tokens"), int)
                               or prompt["block_tokens"] < 1):
        raise TraceError(path, "header.prompt_blocks.block_tokens must be a positive integer")
    check_header_bounds(path, header)
    return header


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    idx = pc.index(mask, True).as_py()
    return None if idx < 0 else idx


def validate_table(path: Path, spec: schema.Table, table: pa.Table) -> None:
    """Columns present, of the right type, and non-null where they must be."""
    names = set(table.column_names)
    known = {c.name for c in spec.columns}
    for name in table.column_names:
        if name not in known:
            raise TraceError(path, f"unknown column (known: {', '.join(sorted(known))})", column=name)
    for col in spec.columns:
        if col.name not in names:
            if col.required:
                raise TraceError(path, "missing column", column=col.name)
            continue
        actual = table.schema.field(col.name).type
        if not actual.equals(col.type):
            raise TraceError(path, f"wrong type {actual}, expected {col.type}", column=col.name)
        if not col.nullable and table[col.name].null_count:
            row = _first_true(pc.is_null(table[col.name]))
            raise TraceError(path, "null value", column=col.name, row=row)


def _check_unique(path: Path, column: pa.ChunkedArray, name: str) -> None:
    """The first row whose id an earlier row has, named; in Arrow and numpy, so a
    day of traffic never becomes a set of Python strings."""
    if pc.count_distinct(column).as_py() == len(column):
        return
    codes = pc.dictionary_encode(column.combine_chunks()).indices.to_numpy()
    repeat = np.ones(len(codes), dtype=bool)
    repeat[np.unique(codes, return_index=True)[1]] = False
    row = int(np.flatnonzero(repeat)[0])
    raise TraceError(path, f"duplicate request id {column[row].as_py()!r}", column=name, row=row)


def _check_after_known(path: Path, requests: pa.Table) -> None:
    """Every ``after`` names a request of the table (vectorised, like the id check)."""
    after = requests["after"]
    if after.null_count == len(after):
        return
    ids = requests["id"].combine_chunks()
    unknown = pc.and_(pc.is_valid(after), pc.invert(pc.is_in(after, value_set=ids)))
    row = _first_true(unknown)
    if row is not None:
        raise TraceError(path, f"request arrives after unknown id {after[row].as_py()!r}",
                         column="after", row=row)


def validate_requests(path: Path, header: dict[str, Any], requests: pa.Table) -> None:
    _check_unique(path, requests["id"], "id")
    names = set(requests.column_names)
    if "after" in names:
        _check_after_known(path, requests)
    check_request_bounds(path, header["engine"], requests)
    n = requests["num_prompt_tokens"]
    row = _first_true(pc.less(n, 1))
    if row is not None:
        raise TraceError(path, "a prompt needs at least one token", column="num_prompt_tokens", row=row)
    row = _first_true(pc.less(requests["output_len"], 1))
    if row is not None:
        raise TraceError(path, "output_len must be at least 1", column="output_len", row=row)
    if "arrival_step" in names:
        row = _first_true(pc.fill_null(pc.less(requests["arrival_step"], 0), False))
        if row is not None:
            raise TraceError(path, "negative arrival step", column="arrival_step", row=row)
    vocab = header["engine"].vocab_size
    has_tokens = "prompt_tokens" in names
    has_blocks = "prompt_block_ids" in names
    if not has_tokens and not has_blocks:
        raise TraceError(path, "missing column (a trace needs prompt_tokens or prompt_block_ids)",
                         column="prompt_tokens")
    tokens_null = pc.is_null(requests["prompt_tokens"]) if has_tokens else None
    blocks_null = pc.is_null(requests["prompt_block_ids"]) if has_blocks else None
    if tokens_null is not None and blocks_null is not None:
        neither = pc.and_(tokens_null, blocks_null)
    else:
        neither = tokens_null if tokens_null is not None else blocks_null
    row = _first_true(neither)
    if row is not None:
        raise TraceError(path, "request has no prompt", column="prompt_tokens", row=row)
    if has_tokens:
        _check_token_lists(path, requests, "prompt_tokens", vocab, lengths=n)
    if has_blocks:
        block = (header.get("prompt_blocks") or {}).get("block_tokens")
        if block is None:
            raise TraceError(path, "prompt_block_ids needs header.prompt_blocks.block_tokens",
                             column="prompt_block_ids")
        col = requests["prompt_block_ids"]
        max_len = pc.multiply(pc.list_value_length(col), block)
        bad = pc.fill_null(pc.greater(n, max_len), False)
        row = _first_true(bad)
        if row is not None:
            raise TraceError(path, "num_prompt_tokens exceeds the blocks listed",
                             column="prompt_block_ids", row=row)
    if "output_tokens" in names:
        _check_token_lists(path, requests, "output_tokens", vocab, lengths=requests["output_len"])


def _check_token_lists(path: Path, table: pa.Table, name: str, vocab: int,
                       lengths: pa.ChunkedArray) -> None:
    col = table[name]
    lens = pc.list_value_length(col)
    bad_len = pc.fill_null(pc.not_equal(lens, lengths), False)
    row = _first_true(bad_len)
    if row is not None:
        what = "num_prompt_tokens" if name == "prompt_tokens" else "output_len"
        raise TraceError(path, f"list length differs from {what}", column=name, row=row)
    for chunk_start, chunk in _chunks(col):
        flat = pc.list_flatten(chunk)
        if len(flat) == 0:
            continue
        out = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, vocab))
        pos = _first_true(out)
        if pos is not None:
            parents = pc.list_parent_indices(chunk)
            row = chunk_start + parents[pos].as_py()
            raise TraceError(path, f"token id {flat[pos].as_py()} out of vocabulary "
                                   f"[0, {vocab})", column=name, row=row)


def _chunks(col: pa.ChunkedArray):
    start = 0
    for chunk in col.chunks:
        yield start, chunk
        start += len(chunk)


def validate_events(path: Path, events: pa.Table, ids: set[str]) -> None:
    for row, ev in enumerate(events.to_pylist()):
        if ev["action"] not in schema.EVENT_ACTIONS:
            raise TraceError(path, f"unknown action {ev['action']!r} "
                                   f"(known: {', '.join(schema.EVENT_ACTIONS)})",
                             column="action", row=row)
        if (ev["after"] is None) == (ev["at_step"] is None):
            raise TraceError(path, "an event needs exactly one of after / at_step",
                             column="after", row=row)
        if ev["after"] is not None and ev["after"] not in ids:
            raise TraceError(path, f"event after unknown id {ev['after']!r}", column="after", row=row)
        check_event_row(path, row, ev, ids)


def validate_trace(root: Path, trace: "Trace") -> None:
    # A trace built from one source file (scenario, imported trace) names that file.
    def where(name: str) -> Path:
        return root if root.is_file() else root / name

    check_async_scheduling(where(schema.HEADER_FILE), trace.engine,
                           (trace.header.get("source") or {}).get("kind"))
    validate_requests(where(schema.REQUESTS.file), trace.header, trace.requests)
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
