"""Store goldens: the keys written per group and boundary, and lookup hit lengths.

A key is named by what it means rather than its hash: the first request whose
prompt holds that prefix, the KV-cache group, and the token boundary it ends
at. So a golden reads ``first: {0: [1536, 3072], 1: [6144]}`` and a miss
report says "group 1 @ 7296 (first) missing", whatever hash seed ran.

In memory: ``{"puts": {request: {group: [boundaries]}}, "lookups": {request: hit}}``.
A request looked up more than once keeps its first lookup (the one that decided
its hit). In a scenario: ``expect_store: {puts: {...}, lookups: {...}}``; in
a trace directory: ``golden/store-vllm-X.parquet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from . import schema
from .errors import TraceError, require_int
from .golden_kind import GoldenKind

StoreExpect = dict[str, dict[str, Any]]


def from_report(rows: list[dict[str, Any]], lookups: list[dict[str, Any]]) -> StoreExpect:
    """The store golden a replay produced (successful puts; first lookup per request)."""
    puts: dict[str, dict[int, list[int]]] = {}
    for r in rows:
        if r["op"] != "put" or r["result"] is None or r["result"] < 0:
            continue
        req = r.get("request") or "?"
        group = -1 if r["group"] is None else r["group"]
        boundary = -1 if r["boundary"] is None else r["boundary"]
        puts.setdefault(req, {}).setdefault(group, []).append(boundary)
    for groups in puts.values():
        for g in groups:
            groups[g] = sorted(set(groups[g]))
    hits: dict[str, int] = {}
    for x in lookups:
        hits.setdefault(x["request"], x["hit_length"])
    return {"puts": {k: dict(sorted(v.items())) for k, v in puts.items()}, "lookups": hits}


def to_table(expect: StoreExpect, engine_key: str) -> pa.Table:
    rows = []
    for req, groups in expect.get("puts", {}).items():
        for g, boundaries in groups.items():
            rows += [{"kind": "put", "request": req, "group": int(g), "boundary": int(b),
                      "hit_length": None} for b in boundaries]
    for req, hit in expect.get("lookups", {}).items():
        rows.append({"kind": "lookup", "request": req, "group": None, "boundary": None,
                     "hit_length": int(hit)})
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN_STORE.arrow_schema())
    return table.replace_schema_metadata({"engine": engine_key})


def from_table(table: pa.Table) -> StoreExpect:
    puts: dict[str, dict[int, list[int]]] = {}
    hits: dict[str, int] = {}
    for r in table.to_pylist():
        if r["kind"] == "put":
            puts.setdefault(r["request"], {}).setdefault(r["group"], []).append(r["boundary"])
        else:
            hits[r["request"]] = r["hit_length"]
    return {"puts": puts, "lookups": hits}


@dataclass(frozen=True)
class StoreMismatch:
    what: str          # "missing put" | "extra put" | "lookup"
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


def compare_store(expect: StoreExpect, actual: StoreExpect) -> list[StoreMismatch]:
    out: list[StoreMismatch] = []
    exp_puts = {(r, int(g), int(b)) for r, gs in expect.get("puts", {}).items()
                for g, bs in gs.items() for b in bs}
    act_puts = {(r, int(g), int(b)) for r, gs in actual.get("puts", {}).items()
                for g, bs in gs.items() for b in bs}
    if "puts" in expect:
        for r, g, b in sorted(exp_puts - act_puts, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch("missing put", r, g, b))
        for r, g, b in sorted(act_puts - exp_puts, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch("extra put", r, g, b))
    for req, hit in expect.get("lookups", {}).items():
        got = actual.get("lookups", {}).get(req)
        if got != hit:
            out.append(StoreMismatch("lookup", req, expected=hit, actual=got))
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
        for key in body:
            if key not in ("puts", "lookups"):
                raise TraceError(path, f"unknown key {key!r} in {where} (known: puts, lookups)")
        puts: dict[str, dict[int, list[int]]] = {}
        for rid, groups in (body.get("puts") or {}).items():
            rid = str(rid)
            if rid not in ids:
                raise TraceError(path, f"{where}.puts names unknown request {rid!r}")
            if not isinstance(groups, dict):
                raise TraceError(path, f"{where}.puts.{rid} must map group -> [boundaries]")
            puts[rid] = {}
            for g, bs in groups.items():
                g = require_int(path, f"{where}.puts.{rid} group", g, 0)
                if not isinstance(bs, list):
                    raise TraceError(path, f"{where}.puts.{rid}.{g} must be a list of boundaries")
                puts[rid][g] = [require_int(path, f"{where}.puts.{rid}.{g}[]", b, 1) for b in bs]
        lookups: dict[str, int] = {}
        for rid, hit in (body.get("lookups") or {}).items():
            rid = str(rid)
            if rid not in ids:
                raise TraceError(path, f"{where}.lookups names unknown request {rid!r}")
            lookups[rid] = require_int(path, f"{where}.lookups.{rid}", hit, 0)
        entry: StoreExpect = {"lookups": lookups}
        if "puts" in body:
            entry["puts"] = puts
        return entry

    def to_yaml(self, expect: StoreExpect) -> dict[str, Any]:
        return {"puts": {rid: {int(g): [int(b) for b in bs] for g, bs in groups.items()}
                         for rid, groups in expect.get("puts", {}).items()},
                "lookups": dict(expect.get("lookups", {}))}

    def from_table(self, table: pa.Table) -> StoreExpect:
        return from_table(table)

    def to_table(self, expect: StoreExpect, key: str) -> pa.Table:
        return to_table(expect, key)

    def count(self, expect: StoreExpect) -> tuple[int, int]:
        """(keys written, lookups) an expectation holds."""
        puts = sum(len(b) for g in expect.get("puts", {}).values() for b in g.values())
        return puts, len(expect.get("lookups", {}))


STORE = StoreGoldens()
