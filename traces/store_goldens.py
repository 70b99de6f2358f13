"""Store goldens: the keys written per group and boundary, and lookup hit lengths.

A key is named by what it means rather than its hash: the first request whose
prompt holds that prefix, the KV-cache group, and the token boundary it ends
at. So a golden reads ``first: {0: [1536, 3072], 1: [6144]}`` and a miss
report says "group 1 @ 7296 (first) missing", whatever hash seed ran.

In memory: ``{"puts": {request: {group: [boundaries]}}, "gets": {loader:
{group: [boundaries]}}, "lookups": {request: hit}}``. Puts are filed under
the key's first request, gets under the request whose load fetched them (the
boundary is a position in its own prompt). A request looked up more than once
keeps its first lookup (the one that decided its hit). ``puts`` and ``gets``
are checked only where the golden has them. In a scenario:
``expect_store: {puts: {...}, gets: {...}, lookups: {...}}``; in a trace
directory: ``golden/store-vllm-X.parquet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from . import schema
from .errors import TraceError, reject_unknown_keys, require_int
from .golden_kind import GoldenKind

StoreExpect = dict[str, dict[str, Any]]


def _by_group(rows: list[dict[str, Any]], op: str, who: str) -> dict[str, dict[int, list[int]]]:
    """{request: {group: sorted boundaries}} of the successful ``op`` rows, filed
    under the row's ``who`` (``request``: the key's first request; ``loader``)."""
    out: dict[str, dict[int, list[int]]] = {}
    for r in rows:
        if r["op"] != op or r["result"] is None or r["result"] < 0:
            continue
        req = r.get(who) or "?"
        group = -1 if r["group"] is None else r["group"]
        boundary = -1 if r["boundary"] is None else r["boundary"]
        out.setdefault(req, {}).setdefault(group, []).append(boundary)
    for groups in out.values():
        for g in groups:
            groups[g] = sorted(set(groups[g]))
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def from_report(rows: list[dict[str, Any]], lookups: list[dict[str, Any]]) -> StoreExpect:
    """The store golden a replay produced: successful puts by the key's first
    request, successful gets by the request whose load fetched them, and the
    first lookup per request."""
    hits: dict[str, int] = {}
    for x in lookups:
        hits.setdefault(x["request"], x["hit_length"])
    out: StoreExpect = {"puts": _by_group(rows, "put", "request"), "lookups": hits}
    gets = _by_group(rows, "get", "loader")
    if gets:            # none (no lookup hit) is left out, as a golden table has no rows
        out["gets"] = gets
    return out


def to_table(expect: StoreExpect, engine_key: str) -> pa.Table:
    rows = []
    for kind in ("put", "get"):
        for req, groups in expect.get(kind + "s", {}).items():
            for g, boundaries in groups.items():
                rows += [{"kind": kind, "request": req, "group": int(g), "boundary": int(b),
                          "hit_length": None} for b in boundaries]
    for req, hit in expect.get("lookups", {}).items():
        rows.append({"kind": "lookup", "request": req, "group": None, "boundary": None,
                     "hit_length": int(hit)})
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN_STORE.arrow_schema())
    return table.replace_schema_metadata({"engine": engine_key})


def from_table(table: pa.Table) -> StoreExpect:
    """A golden table as an expectation; ``gets`` only when the table has get rows
    (a table written before gets were recorded checks puts and lookups only)."""
    keyed: dict[str, dict[str, dict[int, list[int]]]] = {"put": {}, "get": {}}
    hits: dict[str, int] = {}
    for r in table.to_pylist():
        if r["kind"] in keyed:
            keyed[r["kind"]].setdefault(r["request"], {}).setdefault(
                r["group"], []).append(r["boundary"])
        else:
            hits[r["request"]] = r["hit_length"]
    out: StoreExpect = {"puts": keyed["put"], "lookups": hits}
    if keyed["get"]:
        out["gets"] = keyed["get"]
    return out


@dataclass(frozen=True)
class StoreMismatch:
    what: str          # "missing put" | "extra put" | "missing get" | "extra get" | "lookup"
    request: str
    group: int | None = None
    boundary: int | None = None
    expected: int | None = None
    actual: int | None = None

    def describe(self) -> str:
        if self.what == "lookup":
            return (f"lookup of {self.request}: hit_length expected {self.expected}, "
                    f"got {self.actual}")
        return f"{self.what}: group {self.group} @ {self.boundary} ({self.request})"


def _triples(keyed: dict[str, dict[int, list[int]]]) -> set[tuple[str, int, int]]:
    return {(r, int(g), int(b)) for r, gs in keyed.items() for g, bs in gs.items() for b in bs}


def compare_store(expect: StoreExpect, actual: StoreExpect) -> list[StoreMismatch]:
    """Puts and gets (each only where the golden has that block), then lookups."""
    out: list[StoreMismatch] = []
    for block, op in (("puts", "put"), ("gets", "get")):
        if block not in expect:
            continue
        want, got = _triples(expect[block]), _triples(actual.get(block, {}))
        for r, g, b in sorted(want - got, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch(f"missing {op}", r, g, b))
        for r, g, b in sorted(got - want, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch(f"extra {op}", r, g, b))
    for req, hit in expect.get("lookups", {}).items():
        got = actual.get("lookups", {}).get(req)
        if got != hit:
            out.append(StoreMismatch("lookup", req, expected=hit, actual=got))
    return out


def _parse_keyed(path: Path, where: str, raw: Any,
                 ids: set[str]) -> dict[str, dict[int, list[int]]]:
    """``{request: {group: [boundaries]}}`` of a ``puts`` or ``gets`` block, checked."""
    out: dict[str, dict[int, list[int]]] = {}
    if raw is not None and not isinstance(raw, dict):
        raise TraceError(path, f"{where} must map request -> {{group: [boundaries]}}")
    for rid, groups in (raw or {}).items():
        rid = str(rid)
        if rid not in ids:
            raise TraceError(path, f"{where} names unknown request {rid!r}")
        if not isinstance(groups, dict):
            raise TraceError(path, f"{where}.{rid} must map group -> [boundaries]")
        out[rid] = {}
        for g, bs in groups.items():
            g = require_int(path, f"{where}.{rid} group", g, 0)
            if not isinstance(bs, list):
                raise TraceError(path, f"{where}.{rid}.{g} must be a list of boundaries")
            out[rid][g] = [require_int(path, f"{where}.{rid}.{g}[]", b, 1) for b in bs]
    return out


class StoreGoldens(GoldenKind):
    name = "store"
    block = "expect_store"
    levels = 2           # puts | lookups -> request id -> groups or hit
    attr = "store_goldens"
    file_prefix = "store-"
    table = schema.GOLDEN_STORE

    def parse_body(self, path: Path, where: str, body: dict[str, Any],
                   ids: set[str]) -> StoreExpect:
        reject_unknown_keys(path, where, body, ("puts", "gets", "lookups"))
        keyed = {block: _parse_keyed(path, f"{where}.{block}", body.get(block), ids)
                 for block in ("puts", "gets")}
        lookups: dict[str, int] = {}
        for rid, hit in (body.get("lookups") or {}).items():
            rid = str(rid)
            if rid not in ids:
                raise TraceError(path, f"{where}.lookups names unknown request {rid!r}")
            lookups[rid] = require_int(path, f"{where}.lookups.{rid}", hit, 0)
        entry: StoreExpect = {"lookups": lookups}
        for block in ("puts", "gets"):
            if block in body:
                entry[block] = keyed[block]
        return entry

    def to_yaml(self, expect: StoreExpect) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for block in ("puts", "gets"):
            if block == "puts" or expect.get(block):
                out[block] = {rid: {int(g): [int(b) for b in bs] for g, bs in groups.items()}
                              for rid, groups in expect.get(block, {}).items()}
        out["lookups"] = dict(expect.get("lookups", {}))
        return out

    def from_table(self, table: pa.Table) -> StoreExpect:
        return from_table(table)

    def to_table(self, expect: StoreExpect, key: str) -> pa.Table:
        return to_table(expect, key)

    def count(self, expect: StoreExpect) -> tuple[int, int]:
        """(keys written, lookups) an expectation holds."""
        return self.keys(expect, "puts"), len(expect.get("lookups", {}))

    @staticmethod
    def keys(expect: StoreExpect, block: str) -> int:
        """Keys a ``puts`` or ``gets`` block names."""
        return sum(len(b) for g in expect.get(block, {}).values() for b in g.values())


STORE = StoreGoldens()
