"""What differs in the store between two replays of one trace (``diff``, ``bisect``).

Keys are compared by meaning, as store goldens name them
(:func:`traces.goldens.store.from_report`): the first request whose prompt
holds the prefix, the KV-cache group, the token boundary. So two engines
whose hashes differ (another hash seed, another release) still compare key for
key, and a key written by one side only reads ``group 1 @ 7296 (p7449)``.
Where either side ran more than one worker rank, keys compare rank by rank
(``group 1 @ 7296 (p7449) on rank 1``): one rank's lost shard is a difference.
Lookups compare by request: the hit length the store answered (the first
lookup of each request, the one that decided its hit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traces.goldens.store import compare_store, from_report

MAX_LINES = 20          # key and lookup lines in the table; --json has them all


@dataclass(frozen=True)
class StoreKey:
    request: str
    group: int
    boundary: int
    rank: int | None = None          # None: compared over all ranks (one rank each side)

    def describe(self) -> str:
        on = "" if self.rank is None else f" on rank {self.rank}"
        return f"group {self.group} @ {self.boundary} ({self.request}){on}"

    def as_dict(self) -> dict[str, Any]:
        out = {"request": self.request, "group": self.group, "boundary": self.boundary}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True)
class LookupDiff:
    request: str
    a: int | None          # None: that side never looked this request up
    b: int | None

    def describe(self) -> str:
        def f(v: int | None) -> str:
            return "none" if v is None else str(v)
        return f"lookup of {self.request}: hit_length A {f(self.a)}, B {f(self.b)}"

    def as_dict(self) -> dict[str, Any]:
        return {"request": self.request, "a": self.a, "b": self.b}


@dataclass(frozen=True)
class StoreDiff:
    keys: int                      # distinct keys written on A
    lookups: int                   # requests looked up on A
    only_a: list[StoreKey]         # written on A, not on B (group, boundary order)
    only_b: list[StoreKey]
    lookup_diffs: list[LookupDiff]

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.lookup_diffs)

    def as_dict(self) -> dict[str, Any]:
        return {"identical": self.identical,
                "only_a": [k.as_dict() for k in self.only_a],
                "only_b": [k.as_dict() for k in self.only_b],
                "lookups": [x.as_dict() for x in self.lookup_diffs]}


def _named(report: dict[str, Any] | None) -> dict[str, Any]:
    if report is None:
        return {"puts": {}, "lookups": {}}
    return from_report(report["rows"], report["lookups"])


def compare_stores(a: dict[str, Any] | None, b: dict[str, Any] | None) -> StoreDiff | None:
    """A's and B's store reports compared by meaning (None when neither has one)."""
    if a is None and b is None:
        return None
    na, nb = _named(a), _named(b)
    only_a: list[StoreKey] = []
    only_b: list[StoreKey] = []
    # compare_store reads A as the expectation: "missing" is A's only, "extra" B's.
    if "ranks" in na or "ranks" in nb:
        ranks_a, ranks_b = na.get("ranks") or {0: na}, nb.get("ranks") or {0: nb}
        expect = {"puts": {}, "ranks": {r: {"puts": ranks_a.get(r, {}).get("puts", {})}
                                        for r in sorted(set(ranks_a) | set(ranks_b))}}
        actual = {"puts": {}, "ranks": ranks_b}
    else:
        expect, actual = {"puts": na["puts"]}, {"puts": nb["puts"]}
    for m in compare_store(expect, actual):
        key = StoreKey(m.request, int(m.group or 0), int(m.boundary or 0), m.rank)
        (only_a if m.what == "missing put" else only_b).append(key)
    hits_a, hits_b = na["lookups"], nb["lookups"]
    order = list(hits_a) + [r for r in hits_b if r not in hits_a]
    lookup_diffs = [LookupDiff(r, hits_a.get(r), hits_b.get(r)) for r in order
                    if hits_a.get(r) != hits_b.get(r)]
    keys = sum(len(bs) for groups in na["puts"].values() for bs in groups.values())
    return StoreDiff(keys, len(hits_a), only_a, only_b, lookup_diffs)


def store_lines(d: StoreDiff) -> list[str]:
    """The store part of ``diff``'s table: a summary line, then each difference."""
    if d.identical:
        return [f"store: the same {d.keys} key(s) and {d.lookups} lookup(s) on A and B"]
    head = (f"store: {len(d.only_a)} key(s) only on A, {len(d.only_b)} only on B, "
            f"{len(d.lookup_diffs)} lookup(s) differ")
    body = ([f"  only on A: {k.describe()}" for k in d.only_a]
            + [f"  only on B: {k.describe()}" for k in d.only_b]
            + [f"  {x.describe()}" for x in d.lookup_diffs])
    if len(body) > MAX_LINES:
        body = body[:MAX_LINES] + [f"  ... and {len(body) - MAX_LINES} more (--json has them all)"]
    return [head, *body]
