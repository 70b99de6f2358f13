"""Golden expectations: one form in memory, one comparison rule for every caller.

In memory a trace's goldens are ``{engine key: {request id: {field: value}}}``.
A scenario's ``expect:`` lists only the fields it cares about; a trace
directory's golden table holds every outcome field. Both are compared by
:func:`compare`, so there is exactly one definition of "matches".
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from . import schema
from .outcome import RequestOutcome

ANY_ENGINE = "*"
EXPECT_FIELDS = schema.OUTCOME_FIELDS

Goldens = dict[str, dict[str, dict[str, int]]]


def select(goldens: Goldens, engine_key: str) -> tuple[str, dict[str, dict[str, int]]] | None:
    """The goldens recorded for ``engine_key``, else those for any engine."""
    if engine_key in goldens:
        return engine_key, goldens[engine_key]
    if ANY_ENGINE in goldens:
        return ANY_ENGINE, goldens[ANY_ENGINE]
    return None


def expect_from_results(results: list[RequestOutcome]) -> dict[str, dict[str, int | None]]:
    """Every outcome field of every request: a trace directory's golden."""
    return {r.id: r.observed() for r in results}


def table_from_expect(expect: dict[str, dict[str, int | None]], engine_key: str) -> pa.Table:
    rows = [{"id": rid, **{k: fields.get(k) for k in EXPECT_FIELDS}}
            for rid, fields in expect.items()]
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN.arrow_schema())
    return table.replace_schema_metadata({"engine": engine_key})


def expect_from_table(table: pa.Table) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in table.to_pylist():
        rid = row.pop("id")
        out[rid] = {k: v for k, v in row.items() if v is not None}
    return out


@dataclass(frozen=True)
class Mismatch:
    request: str
    field: str
    expected: int | None
    actual: int | None
    arrival_index: int     # position in arrival order: the first is "the first divergence"


def compare(expect: dict[str, dict[str, int]], results: list[RequestOutcome]) -> list[Mismatch]:
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
