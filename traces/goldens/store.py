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

Ranks: ``puts`` and ``gets`` hold what every worker rank wrote and fetched
together (keys by meaning; at one rank, that rank's). With more than one rank a
replay also files each rank's own under ``ranks: {R: {puts, gets}}``, checked
rank by rank where the golden has that rank, so a shard one rank lost shows
as ``missing put ... on rank 1``. A lookup given as ``null`` asserts that the
request was never looked up; ``match: subset`` checks that the golden's keys
are there and lets others be (a fixture need not list keys it is not about).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from traces.goldens.kind import GoldenKind
from traces.model import schema
from traces.model.errors import TraceError, reject_unknown_keys, require_int

StoreExpect = dict[str, dict[str, Any]]


MATCHES = ("all", "subset")


def _by_group(rows: list[dict[str, Any]], op: str, who: str,
              rank: int | None = None) -> dict[str, dict[int, list[int]]]:
    """{request: {group: sorted boundaries}} of the successful ``op`` rows (of one
    rank, or all), filed under the row's ``who`` (``request``: the key's first
    request; ``loader``)."""
    out: dict[str, dict[int, list[int]]] = {}
    for r in rows:
        if r["op"] != op or r["result"] is None or r["result"] < 0:
            continue
        if rank is not None and r.get("rank", 0) != rank:
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
    ranks = sorted({r.get("rank", 0) or 0 for r in rows})
    if len(ranks) > 1:
        out["ranks"] = {}
        for rank in ranks:
            own: dict[str, Any] = {"puts": _by_group(rows, "put", "request", rank)}
            own_gets = _by_group(rows, "get", "loader", rank)
            if own_gets:
                own["gets"] = own_gets
            out["ranks"][rank] = own
    return out


def to_table(expect: StoreExpect, engine_key: str) -> pa.Table:
    """One row per key (``rank`` null: all ranks'; a number: that rank's own) and
    per lookup (``hit_length`` null: never looked up); ``rank`` only where some
    row has one, so a single-rank golden reads as before."""
    rows = []
    blocks = [(None, expect)] + sorted((int(r), v) for r, v in expect.get("ranks", {}).items())
    for rank, block in blocks:
        for kind in ("put", "get"):
            for req, groups in block.get(kind + "s", {}).items():
                for g, boundaries in groups.items():
                    rows += [{"kind": kind, "request": req, "group": int(g),
                              "boundary": int(b), "hit_length": None, "rank": rank}
                             for b in boundaries]
    for req, hit in expect.get("lookups", {}).items():
        rows.append({"kind": "lookup", "request": req, "group": None, "boundary": None,
                     "hit_length": None if hit is None else int(hit), "rank": None})
    present = {c.name for c in schema.GOLDEN_STORE.columns}
    if "ranks" not in expect:
        present.discard("rank")
        rows = [{k: v for k, v in r.items() if k != "rank"} for r in rows]
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN_STORE.arrow_schema(present))
    return table.replace_schema_metadata({"engine": engine_key})


def from_table(table: pa.Table) -> StoreExpect:
    """A golden table as an expectation; ``gets`` only when the table has get rows
    (a table written before gets were recorded checks puts and lookups only)."""
    keyed: dict[int | None, dict[str, dict[str, dict[int, list[int]]]]] = {
        None: {"put": {}, "get": {}}}
    hits: dict[str, int | None] = {}
    for r in table.to_pylist():
        if r["kind"] in ("put", "get"):
            per = keyed.setdefault(r.get("rank"), {"put": {}, "get": {}})
            per[r["kind"]].setdefault(r["request"], {}).setdefault(
                r["group"], []).append(r["boundary"])
        else:
            hits[r["request"]] = r["hit_length"]
    out: StoreExpect = {"puts": keyed[None]["put"], "lookups": hits}
    if keyed[None]["get"]:
        out["gets"] = keyed[None]["get"]
    ranks = {rank: per for rank, per in keyed.items() if rank is not None}
    if ranks:
        out["ranks"] = {rank: {"puts": per["put"], **({"gets": per["get"]} if per["get"] else {})}
                        for rank, per in sorted(ranks.items())}
    return out


@dataclass(frozen=True)
class StoreMismatch:
    what: str          # "missing put" | "extra put" | "missing get" | "extra get" | "lookup"
    request: str
    group: int | None = None
    boundary: int | None = None
    expected: int | None = None
    actual: int | None = None
    rank: int | None = None        # a key of one rank's own block (None: all ranks')

    def describe(self) -> str:
        if self.what == "lookup":
            none = lambda v: "no lookup" if v is None else v  # noqa: E731
            return (f"lookup of {self.request}: hit_length expected {none(self.expected)}, "
                    f"got {none(self.actual)}")
        on = "" if self.rank is None else f" on rank {self.rank}"
        return f"{self.what}: group {self.group} @ {self.boundary} ({self.request}){on}"


def _triples(keyed: dict[str, dict[int, list[int]]]) -> set[tuple[str, int, int]]:
    return {(r, int(g), int(b)) for r, gs in keyed.items() for g, bs in gs.items() for b in bs}


def _compare_keys(expect: dict[str, Any], actual: dict[str, Any], subset: bool,
                  rank: int | None) -> list[StoreMismatch]:
    out: list[StoreMismatch] = []
    for block, op in (("puts", "put"), ("gets", "get")):
        if block not in expect:
            continue
        want, got = _triples(expect[block]), _triples(actual.get(block, {}))
        for r, g, b in sorted(want - got, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch(f"missing {op}", r, g, b, rank=rank))
        if subset:
            continue
        for r, g, b in sorted(got - want, key=lambda x: (x[1], x[2], x[0])):
            out.append(StoreMismatch(f"extra {op}", r, g, b, rank=rank))
    return out


def compare_store(expect: StoreExpect, actual: StoreExpect) -> list[StoreMismatch]:
    """Puts and gets (each only where the golden has that block; all ranks', then
    each rank's own the golden names), then lookups. ``match: subset``: the
    golden's keys must be there, others may be."""
    subset = expect.get("match") == "subset"
    out = _compare_keys(expect, actual, subset, None)
    # A replay at one rank files everything as rank 0's.
    ranks = actual.get("ranks") or {0: actual}
    for rank, own in sorted(expect.get("ranks", {}).items()):
        out += _compare_keys(own, ranks.get(rank, {}), subset, rank)
    for req, hit in expect.get("lookups", {}).items():
        got = actual.get("lookups", {}).get(req)
        if got != hit:
            out.append(StoreMismatch("lookup", req, expected=hit, actual=got))
    return out


def _parse_ranks(path: Path, where: str, raw: Any, ids: set[str]) -> dict[int, dict[str, Any]]:
    """``{rank: {puts?, gets?}}``: each rank's own keys, checked."""
    if not isinstance(raw, dict) or not raw:
        raise TraceError(path, f"{where} must map rank -> {{puts: ..., gets: ...}}")
    out: dict[int, dict[str, Any]] = {}
    for rank, body in raw.items():
        rank = require_int(path, f"{where} rank", rank, 0)
        if not isinstance(body, dict):
            raise TraceError(path, f"{where}.{rank} must map puts/gets -> "
                                   "{request: {group: [boundaries]}}")
        reject_unknown_keys(path, f"{where}.{rank}", body, ("puts", "gets"))
        out[rank] = {block: _parse_keyed(path, f"{where}.{rank}.{block}", body[block], ids)
                     for block in ("puts", "gets") if block in body}
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
        reject_unknown_keys(path, where, body, ("puts", "gets", "lookups", "ranks", "match"))
        keyed = {block: _parse_keyed(path, f"{where}.{block}", body.get(block), ids)
                 for block in ("puts", "gets")}
        lookups: dict[str, int | None] = {}
        for rid, hit in (body.get("lookups") or {}).items():
            rid = str(rid)
            if rid not in ids:
                raise TraceError(path, f"{where}.lookups names unknown request {rid!r}")
            # null: this request must never have been looked up
            lookups[rid] = None if hit is None else require_int(
                path, f"{where}.lookups.{rid}", hit, 0)
        entry: StoreExpect = {"lookups": lookups}
        for block in ("puts", "gets"):
            if block in body:
                entry[block] = keyed[block]
        if "ranks" in body:
            entry["ranks"] = _parse_ranks(path, f"{where}.ranks", body["ranks"], ids)
        if "match" in body:
            if body["match"] not in MATCHES:
                raise TraceError(path, f"{where}.match must be one of {', '.join(MATCHES)}, "
                                       f"got {body['match']!r}")
            entry["match"] = body["match"]
        return entry

    def to_yaml(self, expect: StoreExpect) -> dict[str, Any]:
        def keyed(block: dict[str, Any]) -> dict[str, Any]:
            return {rid: {int(g): [int(b) for b in bs] for g, bs in groups.items()}
                    for rid, groups in block.items()}

        out: dict[str, Any] = {}
        if expect.get("match", "all") != "all":
            out["match"] = expect["match"]
        for block in ("puts", "gets"):
            if block in expect:        # a block left out is not checked: keep it out
                out[block] = keyed(expect[block])
        out["lookups"] = dict(expect.get("lookups", {}))
        if expect.get("ranks"):
            out["ranks"] = {int(r): {b: keyed(own[b]) for b in ("puts", "gets") if own.get(b)}
                            for r, own in sorted(expect["ranks"].items())}
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
