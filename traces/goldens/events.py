"""KV-event goldens: the blocks vLLM said it stored, skipped and removed, per group.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (what
routers such as llm-d and Dynamo consume): the write side of the prefix cache.
A ``BlockStored`` covers a token range; on a hybrid model with sparse Mamba
retention (or a sliding window) vLLM keeps only some of its blocks. So a
golden names, per first request, group and token boundary (never a hash, so it
holds under any hash seed), the blocks

* ``stored``: kept (in the event's ``block_hashes``),
* ``skipped``: inside an event's range but not kept (intended, not kept),
* ``removed``: evicted (``BlockRemoved``),

and ``cleared``: how many ``AllBlocksCleared`` (a prefix-cache reset) there were.

In memory ``{"stored": {request: {group: [boundaries]}}, ..., "cleared": n}``,
lists in the order vLLM published them (a block stored twice is listed
twice); compared as multisets. A section left out is not checked. In a
scenario: ``expect_events:``, where a run of evenly spaced boundaries may be
written ``"1536..24576/1536"`` (what ``--update-golden`` writes for three or
more); in a trace directory: ``golden/events-vllm-X.parquet``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from traces.goldens.kind import GoldenKind
from traces.model import schema
from traces.model.errors import TraceError, reject_unknown_keys, require_int, short

EventExpect = dict[str, Any]
SECTIONS = ("stored", "skipped", "removed")
# What each section is called in a report, by vLLM's event names.
SECTION_EVENT = {"stored": "BlockStored", "skipped": "BlockStored (not kept)",
                 "removed": "BlockRemoved"}
KEYS = (*SECTIONS, "cleared")
RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*/\s*(\d+)\s*$")
# Boundaries one golden may expand to (a range string is a few characters).
MAX_EXPANDED = 1 << 22


def section_of(event: str, kept: bool | None) -> str | None:
    """The golden section a ``kv_events`` row belongs to (None: AllBlocksCleared)."""
    if event == "BlockStored":
        return "skipped" if kept is False else "stored"
    if event == "BlockRemoved":
        return "removed"
    return None


def from_rows(rows: Iterable[dict[str, Any]]) -> EventExpect:
    """The golden a ``kv_events`` stream makes (every section)."""
    out: EventExpect = {s: {} for s in SECTIONS}
    cleared = 0
    for r in rows:
        section = section_of(r["event"], r.get("kept"))
        if section is None:
            cleared += 1
            continue
        req = r.get("request") or "?"
        group = -1 if r.get("group") is None else int(r["group"])
        boundary = -1 if r.get("boundary") is None else int(r["boundary"])
        out[section].setdefault(req, {}).setdefault(group, []).append(boundary)
    out["cleared"] = cleared
    for s in SECTIONS:
        out[s] = {req: dict(sorted(groups.items())) for req, groups in out[s].items()}
    return out


def compress(boundaries: list[int]) -> list[int | str]:
    """Runs of three or more evenly spaced, rising boundaries as ``"A..B/STEP"``."""
    out: list[int | str] = []
    i, n = 0, len(boundaries)
    while i < n:
        j = i + 1
        if j < n and boundaries[j] > boundaries[i]:
            step = boundaries[j] - boundaries[i]
            while j + 1 < n and boundaries[j + 1] - boundaries[j] == step:
                j += 1
            if j - i >= 2:
                out.append(f"{boundaries[i]}..{boundaries[j]}/{step}")
                i = j + 1
                continue
        out.append(int(boundaries[i]))
        i += 1
    return out


def expand(path: Path, where: str, items: Any, budget: list[int]) -> list[int]:
    """A group's list (boundaries and ``"A..B/STEP"`` runs) as boundaries."""
    if not isinstance(items, list):
        raise TraceError(path, f"{where} must be a list of token boundaries")
    out: list[int] = []
    for i, item in enumerate(items):
        w = f"{where}[{i}]"
        if isinstance(item, str):
            m = RANGE.match(item)
            if m is None:
                raise TraceError(path, f"{w}: expected a token boundary or a run 'A..B/STEP', "
                                       f"got {short(item)}")
            a, b, step = (int(x) for x in m.groups())
            if step < 1 or a < 1 or b < a or (b - a) % step:
                raise TraceError(path, f"{w}: {item!r} is not a run: need 1 <= A <= B and "
                                       "B - A a multiple of STEP >= 1")
            count = (b - a) // step + 1
        else:
            a = require_int(path, w, item, 1)
            b, step, count = a, 1, 1
        budget[0] -= count
        if budget[0] < 0:
            raise TraceError(path, f"{w}: the event goldens expand to more than "
                                   f"{MAX_EXPANDED} boundaries")
        out.extend(range(a, b + 1, step))
    return out


def to_table(expect: EventExpect, engine_key: str) -> pa.Table:
    rows: list[dict[str, Any]] = []
    for section in SECTIONS:
        for req, groups in expect.get(section, {}).items():
            for g, boundaries in groups.items():
                for b, n in Counter(boundaries).items():
                    rows.append({"kind": section, "request": req, "group": int(g),
                                 "boundary": int(b), "count": n})
    if "cleared" in expect:
        rows.append({"kind": "cleared", "request": None, "group": None, "boundary": None,
                     "count": int(expect["cleared"])})
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN_EVENTS.arrow_schema())
    return table.replace_schema_metadata({"engine": engine_key})


def from_table(table: pa.Table) -> EventExpect:
    out: EventExpect = {s: {} for s in SECTIONS}
    out["cleared"] = 0
    for r in table.to_pylist():
        if r["kind"] == "cleared":
            out["cleared"] = r["count"]
        elif r["kind"] in SECTIONS:
            lst = out[r["kind"]].setdefault(r["request"], {}).setdefault(r["group"], [])
            lst.extend([r["boundary"]] * max(int(r["count"]), 0))
    return out


@dataclass(frozen=True)
class EventMismatch:
    what: str                    # "missing" | "extra" | "cleared"
    section: str = ""
    request: str = ""
    group: int | None = None
    boundary: int | None = None
    times: int = 1
    expected: int | None = None
    actual: int | None = None

    def describe(self) -> str:
        if self.what == "cleared":
            return f"AllBlocksCleared: expected {self.expected}, got {self.actual}"
        times = f" x{self.times}" if self.times > 1 else ""
        return (f"{self.what} {SECTION_EVENT[self.section]}: group {self.group} @ "
                f"{self.boundary} ({self.request}){times}")


def _bag(groups_by_req: dict[str, dict[int, list[int]]]) -> Counter:
    return Counter((int(g), int(b), r) for r, gs in groups_by_req.items()
                   for g, bs in gs.items() for b in bs)


def compare_events(expect: EventExpect, actual: EventExpect) -> list[EventMismatch]:
    """Every difference in the sections ``expect`` holds, section by section,
    then by group and boundary."""
    out: list[EventMismatch] = []
    for section in SECTIONS:
        if section not in expect:
            continue
        want, got = _bag(expect[section]), _bag(actual.get(section, {}))
        for what, bag in (("missing", want - got), ("extra", got - want)):
            for (g, b, r), n in sorted(bag.items()):
                out.append(EventMismatch(what, section, r, g, b, n))
    if "cleared" in expect and expect["cleared"] != actual.get("cleared", 0):
        out.append(EventMismatch("cleared", expected=expect["cleared"],
                                 actual=actual.get("cleared", 0)))
    return out


class EventGoldens(GoldenKind):
    name = "kv events"
    block = "expect_events"
    levels = 2           # section -> request id -> groups (cleared: a leaf)
    attr = "event_goldens"
    file_prefix = "events-"
    table = schema.GOLDEN_EVENTS

    def parse_block(self, path: Path, raw: Any, ids: set[str]) -> dict[str, Any]:
        # ``expect_events: {}`` asks for the events with nothing pinned yet
        # (``--update-golden`` fills it): a plain block for any engine.
        if isinstance(raw, dict) and not raw:
            return {"*": {}}
        return super().parse_block(path, raw, ids)

    def parse_body(self, path: Path, where: str, body: dict[str, Any],
                   ids: set[str]) -> EventExpect:
        reject_unknown_keys(path, where, body, KEYS)
        out: EventExpect = {}
        budget = [MAX_EXPANDED]
        for section in SECTIONS:
            if section not in body:
                continue
            raw = body[section] or {}
            if not isinstance(raw, dict):
                raise TraceError(path, f"{where}.{section} must map request -> group -> "
                                       "[boundaries]")
            out[section] = {}
            for rid, groups in raw.items():
                rid = str(rid)
                if rid not in ids:
                    raise TraceError(path, f"{where}.{section} names unknown request {rid!r}")
                if not isinstance(groups, dict):
                    raise TraceError(path, f"{where}.{section}.{rid} must map group -> "
                                           "[boundaries]")
                parsed: dict[int, list[int]] = {}
                for g, items in groups.items():
                    g = require_int(path, f"{where}.{section}.{rid} group", g, 0)
                    parsed[g] = expand(path, f"{where}.{section}.{rid}.{g}", items, budget)
                out[section][rid] = parsed
        if "cleared" in body:
            out["cleared"] = require_int(path, f"{where}.cleared", body["cleared"], 0)
        return out

    def to_yaml(self, expect: EventExpect) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in SECTIONS:
            if section in expect:
                out[section] = {rid: {int(g): compress([int(b) for b in bs])
                                      for g, bs in groups.items()}
                                for rid, groups in expect[section].items()}
        if "cleared" in expect:
            out["cleared"] = int(expect["cleared"])
        return out

    def from_table(self, table: pa.Table) -> EventExpect:
        return from_table(table)

    def to_table(self, expect: EventExpect, key: str) -> pa.Table:
        return to_table(expect, key)

    def updated(self, old: EventExpect | None, got: EventExpect, whole: bool) -> EventExpect:
        """New expectation from a replay: every section (a trace directory's table,
        or a scenario block that pinned none yet), else the sections ``old`` pins."""
        if whole or not old:
            return got
        return {k: got[k] for k in KEYS if k in old}

    def count(self, expect: EventExpect) -> tuple[int, int, int, int]:
        """(stored, skipped, removed, cleared) an expectation holds."""
        n = [sum(len(bs) for gs in expect.get(s, {}).values() for bs in gs.values())
             for s in SECTIONS]
        return n[0], n[1], n[2], int(expect.get("cleared", 0))


EVENTS = EventGoldens()
