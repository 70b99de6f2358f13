"""Request goldens: each request's expected outcome fields, one kind of golden.

In memory a trace's request goldens are ``{engine key: {request id: {field:
value}}}``. A scenario's ``expect:`` lists only the fields it cares about; a
trace directory's ``golden/vllm-X.parquet`` holds every outcome field. Both
are compared by :func:`compare`, so there is exactly one definition of
"matches". The engine-key convention and what kinds share are in
:mod:`.golden_kind`; the store's kind is :mod:`.store_goldens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from traces.goldens.events import EVENTS
from traces.goldens.kind import ANY_ENGINE, GoldenKind, select
from traces.goldens.store import STORE
from traces.model import schema
from traces.model.errors import TraceError, require_int
from traces.model.outcome import RequestOutcome

__all__ = ["ANY_ENGINE", "EXPECT_FIELDS", "KINDS", "REQUEST", "Mismatch", "compare",
           "kind_of_file", "select"]

EXPECT_FIELDS = schema.OUTCOME_FIELDS

Expect = dict[str, dict[str, int]]
Goldens = dict[str, Expect]


class RequestGoldens(GoldenKind):
    name = "request"
    block = "expect"
    levels = 1           # request id -> {field: value}
    attr = "goldens"
    file_prefix = ""
    table = schema.GOLDEN

    def parse_body(self, path: Path, where: str, body: dict[str, Any], ids: set[str]) -> Expect:
        out: Expect = {}
        for rid, fields in body.items():
            rid = str(rid)
            if rid not in ids:
                raise TraceError(path, f"expect names unknown request {rid!r}")
            if not isinstance(fields, dict):
                raise TraceError(path, f"expect.{rid} must be a mapping of fields")
            for k, v in fields.items():
                if k not in EXPECT_FIELDS:
                    raise TraceError(path, f"unknown key {k!r} in expect.{rid} "
                                           f"(known: {', '.join(EXPECT_FIELDS)})")
                if v is not None:        # null: never prefilled (aborted, or its load failed)
                    require_int(path, f"expect.{rid}.{k}", v, 0)
            out[rid] = dict(fields)
        return out

    def to_yaml(self, expect: Expect) -> dict[str, Any]:
        return {rid: {f: fields[f] for f in EXPECT_FIELDS if f in fields}
                for rid, fields in expect.items()}

    def from_table(self, table: pa.Table) -> Expect:
        out: Expect = {}
        for row in table.to_pylist():
            rid = row.pop("id")
            out[rid] = {k: v for k, v in row.items() if v is not None}
        return out

    def to_table(self, expect: Expect, key: str) -> pa.Table:
        rows = [{"id": rid, **{k: fields.get(k) for k in EXPECT_FIELDS}}
                for rid, fields in expect.items()]
        table = pa.Table.from_pylist(rows, schema=schema.GOLDEN.arrow_schema())
        return table.replace_schema_metadata({"engine": key})

    def updated(self, old: Expect | None, results: list[RequestOutcome],
                whole: bool) -> Expect:
        """New expectations from a replay: every outcome field of every request
        (``whole``: a trace directory's table); else the same requests and
        fields as ``old``, or, with none, ``num_cached_tokens`` of each request
        (plus the local/external split where a store served hits)."""
        if whole:
            return {r.id: r.observed() for r in results}
        by_id = {r.id: r for r in results}
        if not old:
            fields = ["num_cached_tokens"]
            if any(r.num_external_cached_tokens for r in results):
                fields += ["num_local_cached_tokens", "num_external_cached_tokens"]
            return {r.id: {f: getattr(r, f) for f in fields} for r in results}
        return {rid: {f: getattr(by_id[rid], f) for f in fields}
                for rid, fields in old.items() if rid in by_id}


REQUEST = RequestGoldens()
KINDS: tuple[GoldenKind, ...] = (REQUEST, STORE, EVENTS)


def kind_of_file(name: str) -> GoldenKind:
    """The kind a table in ``golden/`` holds, by its name (request goldens: no prefix)."""
    return next((k for k in KINDS if k.file_prefix and k.owns_file(name)), REQUEST)


@dataclass(frozen=True)
class Mismatch:
    request: str
    field: str
    expected: int | None
    actual: int | None
    arrival_index: int     # position in arrival order: the first is "the first divergence"


def compare(expect: Expect, results: list[RequestOutcome]) -> list[Mismatch]:
    """Every field that differs, in the order requests arrived."""
    by_id = {r.id: (i, r) for i, r in enumerate(results)}
    out: list[Mismatch] = []
    for rid, fields in expect.items():
        if rid not in by_id:
            for f, v in fields.items():
                out.append(Mismatch(rid, f, v, None, len(results)))
            continue
        idx, res = by_id[rid]
        for f, v in fields.items():
            if getattr(res, f) != v:
                out.append(Mismatch(rid, f, v, getattr(res, f), idx))
    out.sort(key=lambda m: (m.arrival_index, EXPECT_FIELDS.index(m.field)))
    return out
