"""Validation of a trace: every message names the file, and the column and row.

Checks run on Arrow columns (vectorised where the trace can be large), so
validating the whole conversation trace costs milliseconds, not seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from traces.model import schema
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError
from traces.model.events import check_event_row
from traces.model.sanity import check_header_bounds, request_bound_checks


SOURCE_KINDS = ("authored", "imported", "recorded")


def validate_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise TraceError(path, "header must be a JSON object")
    version = header.get("schema_version")
    if version not in schema.READ_VERSIONS:
        raise TraceError(path, f"unknown schema version {version!r} (this replayer reads "
                               f"versions {', '.join(map(str, schema.READ_VERSIONS))})")
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


def validate_table(path: Path, spec: schema.Table, table: pa.Table,
                   file_schema: pa.Schema | None = None) -> None:
    """Columns present, of the right type, and non-null where they must be.

    ``file_schema``: the file's columns, of which ``table`` holds only some (a
    streamed read); nulls are then checked in the columns it holds, which are
    all the non-nullable ones."""
    file_schema = table.schema if file_schema is None else file_schema
    names = set(file_schema.names)
    known = {c.name for c in spec.columns}
    for name in file_schema.names:
        if name not in known:
            raise TraceError(path, f"unknown column (known: {', '.join(sorted(known))})", column=name)
    for col in spec.columns:
        if col.name not in names:
            if col.required:
                raise TraceError(path, "missing column", column=col.name)
            continue
        actual = file_schema.field(col.name).type
        if not actual.equals(col.type) and not any(actual.equals(t) for t in col.older):
            raise TraceError(path, f"wrong type {actual}, expected {col.type}", column=col.name)
        if not col.nullable and table[col.name].null_count:
            row = _first_true(pc.is_null(table[col.name]))
            raise TraceError(path, "null value", column=col.name, row=row)


def _check_unique(path: Path, column: pa.ChunkedArray, name: str) -> None:
    """The first row whose id an earlier row has, named; in Arrow and numpy, so a
    day of traffic never becomes a set of Python strings."""
    if len(column) < 2:
        return
    # Sorted, equal neighbours: a fraction of the memory a hash of every id takes
    # (count_distinct peaks ~95 MB for a day's 288,744 ids, this ~10 MB).
    flat = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    ranked = flat.take(pc.sort_indices(flat))
    if not pc.any(pc.equal(ranked[1:], ranked[:-1])).as_py():
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


Check = Callable[[pa.Table], None]


def request_checks(path: Path, header: dict[str, Any],
                   names: set[str]) -> list[tuple[bool, Check]]:
    """The requests table's checks in the order their errors are reported, each
    ``(reads a list column, check)``; a check raises for the first bad row of
    the table it is given. ``names``: the table's columns."""
    engine = header["engine"]
    checks: list[tuple[bool, Check]] = [(False, lambda t: _check_unique(path, t["id"], "id"))]
    if "after" in names:
        checks.append((False, lambda t: _check_after_known(path, t)))
    checks += request_bound_checks(path, engine, names)

    def first_row(name: str, mask: Callable[[pa.Table], Any], message: str) -> Check:
        def check(t: pa.Table) -> None:
            row = _first_true(mask(t))
            if row is not None:
                raise TraceError(path, message, column=name, row=row)
        return check

    checks.append((False, first_row("num_prompt_tokens", lambda t: pc.less(t["num_prompt_tokens"], 1),
                                    "a prompt needs at least one token")))
    checks.append((False, first_row("output_len", lambda t: pc.less(t["output_len"], 1),
                                    "output_len must be at least 1")))
    if "arrival_step" in names:
        checks.append((False, first_row(
            "arrival_step", lambda t: pc.fill_null(pc.less(t["arrival_step"], 0), False),
            "negative arrival step")))
    vocab = engine.vocab_size
    has_tokens = "prompt_tokens" in names
    has_blocks = "prompt_block_ids" in names
    if not has_tokens and not has_blocks:
        def no_prompt_column(t: pa.Table) -> None:
            raise TraceError(path, "missing column (a trace needs prompt_tokens or "
                                   "prompt_block_ids)", column="prompt_tokens")
        checks.append((False, no_prompt_column))
        return checks

    def neither(t: pa.Table) -> Any:
        nulls = [pc.is_null(t[c]) for c in ("prompt_tokens", "prompt_block_ids") if c in names]
        return nulls[0] if len(nulls) == 1 else pc.and_(*nulls)

    checks.append((True, first_row("prompt_tokens", neither, "request has no prompt")))
    if has_tokens:
        checks += _token_list_checks(path, "prompt_tokens", vocab, "num_prompt_tokens")
    if has_blocks:
        block = (header.get("prompt_blocks") or {}).get("block_tokens")
        if block is None:
            def no_block_tokens(t: pa.Table) -> None:
                raise TraceError(path, "prompt_block_ids needs header.prompt_blocks.block_tokens",
                                 column="prompt_block_ids")
            checks.append((False, no_block_tokens))
        else:
            checks.append((True, first_row(
                "prompt_block_ids",
                lambda t: pc.fill_null(pc.greater(t["num_prompt_tokens"], pc.multiply(
                    pc.list_value_length(t["prompt_block_ids"]), block)), False),
                "num_prompt_tokens exceeds the blocks listed")))
    if "output_tokens" in names:
        checks += _token_list_checks(path, "output_tokens", vocab, "output_len")
    return checks


def validate_requests(path: Path, header: dict[str, Any], requests: pa.Table) -> None:
    for _, check in request_checks(path, header, set(requests.column_names)):
        check(requests)


def validate_request_batches(path: Path, header: dict[str, Any], scalars: pa.Table,
                             names: set[str], batches: Iterable[tuple[int, pa.Table]]) -> None:
    """:func:`validate_requests` for a table read in parts: ``scalars`` holds every
    row of its columns without lists, ``batches`` yield (first row, rows) of
    its list columns with ``num_prompt_tokens`` and ``output_len``. The error
    raised is the one :func:`validate_requests` raises on the whole table: each
    check's first bad row over all batches, of the first check that has one."""
    checks = request_checks(path, header, names)
    found: dict[int, TraceError] = {}

    def run(k: int, check: Check, table: pa.Table, first: int) -> None:
        try:
            check(table)
        except TraceError as exc:
            found[k] = exc if exc.row is None or not first else TraceError(
                exc.path, exc.message, column=exc.column, row=exc.row + first)

    for k, (lists, check) in enumerate(checks):
        if not lists:
            run(k, check, scalars, 0)
            if k in found:
                break                   # later checks cannot report an earlier error
    stop = min(found, default=len(checks))
    list_checks = [(k, check) for k, (lists, check) in enumerate(checks) if lists and k < stop]
    if list_checks:
        for first, batch in batches:
            for k, check in list_checks:
                if k not in found:
                    run(k, check, batch, first)
            if all(k in found for k, _ in list_checks):
                break
    if found:
        raise found[min(found)]


def _token_list_checks(path: Path, name: str, vocab: int, length: str) -> list[tuple[bool, Check]]:
    """A token list's length (equal to column ``length``), then its token ids in the vocabulary."""
    def lengths(t: pa.Table) -> None:
        bad_len = pc.fill_null(pc.not_equal(pc.list_value_length(t[name]), t[length]), False)
        row = _first_true(bad_len)
        if row is not None:
            raise TraceError(path, f"list length differs from {length}", column=name, row=row)

    def in_vocab(t: pa.Table) -> None:
        for chunk_start, chunk in _chunks(t[name]):
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

    return [(True, lengths), (True, in_vocab)]


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
