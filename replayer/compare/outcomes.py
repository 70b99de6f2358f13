"""``replayer diff``: one trace on two engines, and only what differs.

The outcome of a request is what its goldens compare: the cached tokens and
their local/external split (:meth:`RequestOutcome.hits`). :func:`compare_results`
is the one definition of "two engines differ"; ``bisect`` uses it too.

With a connector, the store is compared too (:mod:`replayer.compare.store`): keys
written on one side only, named as store goldens name them (first request,
group, boundary), and lookups whose hit length differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replayer.compare.store import StoreDiff, compare_stores, store_lines
from replayer.replay.engines import EngineInfo
from replayer.replay.loop import ReplayResult


@dataclass(frozen=True)
class RequestDiff:
    id: str
    a: dict[str, int | None]
    b: dict[str, int | None]

    @property
    def delta(self) -> int | None:
        """B's cached tokens minus A's (None when either never reached prefill)."""
        x, y = self.a["num_cached_tokens"], self.b["num_cached_tokens"]
        return None if x is None or y is None else y - x

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "a": self.a, "b": self.b, "delta": self.delta}


@dataclass(frozen=True)
class EngineDiff:
    a: EngineInfo
    b: EngineInfo
    requests: int
    differing: list[RequestDiff]     # in A's arrival order
    gained: int                      # requests with more cached tokens on B
    lost: int                        # requests with fewer
    tokens_gained: int               # B's cached tokens minus A's, over all requests
    store: StoreDiff | None = None   # None: neither side ran a connector

    @property
    def outcomes_identical(self) -> bool:
        return not self.differing

    @property
    def store_identical(self) -> bool:
        return self.store is None or self.store.identical

    @property
    def identical(self) -> bool:
        return self.outcomes_identical and self.store_identical

    @property
    def unchanged(self) -> int:
        return self.requests - self.gained - self.lost

    def summary(self) -> dict[str, int]:
        return {"requests": self.requests, "gained": self.gained, "lost": self.lost,
                "unchanged": self.unchanged, "tokens_gained": self.tokens_gained}

    def as_dict(self) -> dict[str, Any]:
        out = {"a": self.a.as_dict(), "b": self.b.as_dict(), "identical": self.identical,
               "requests": [d.as_dict() for d in self.differing], "summary": self.summary()}
        if self.store is not None:
            out["store"] = self.store.as_dict()
        return out


def compare_results(a: ReplayResult, b: ReplayResult) -> EngineDiff:
    """Every request whose outcome differs between A and B, and the totals."""
    b_by_id = b.by_id()
    if set(b_by_id) != {r.id for r in a.requests}:
        raise ValueError("the two replays are of different traces")
    differing: list[RequestDiff] = []
    gained = lost = tokens = 0
    for ra in a.requests:
        oa, ob = ra.hits(), b_by_id[ra.id].hits()
        if oa == ob:
            continue
        d = RequestDiff(ra.id, oa, ob)
        differing.append(d)
        delta = (ob["num_cached_tokens"] or 0) - (oa["num_cached_tokens"] or 0)
        gained += delta > 0
        lost += delta < 0
        tokens += delta
    return EngineDiff(a.engine, b.engine, len(a.requests), differing, gained, lost, tokens,
                      store=compare_stores(a.store, b.store))


def _fmt(v: int | None, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+d}" if sign else str(v)


def diff_table(d: EngineDiff) -> str:
    """The differing requests (A, B, delta), the engines, and a one-line summary."""
    out: list[str] = []
    if d.differing:
        rows = []
        for r in d.differing:
            note = ""     # the split matters only where a store served some of the hit
            if r.a["num_external_cached_tokens"] != r.b["num_external_cached_tokens"]:
                note = (f"local {_fmt(r.a['num_local_cached_tokens'])}->"
                        f"{_fmt(r.b['num_local_cached_tokens'])}, external "
                        f"{_fmt(r.a['num_external_cached_tokens'])}->"
                        f"{_fmt(r.b['num_external_cached_tokens'])}")
            rows.append((r.id, _fmt(r.a["num_cached_tokens"]), _fmt(r.b["num_cached_tokens"]),
                         _fmt(r.delta, sign=True), note))
        heads = ("request", "A cached", "B cached", "delta", "")
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]

        def line(vals) -> str:
            return "  ".join(v.ljust(w) if i in (0, 4) else v.rjust(w)
                             for i, (v, w) in enumerate(zip(vals, widths))).rstrip()

        out.append(line(heads))
        out.extend(line(row) for row in rows)
        out.append("")
    out.append(f"A: {d.a.label}")
    out.append(f"B: {d.b.label}")
    if d.outcomes_identical:
        out.append(f"identical: {d.requests} requests, the same outcome on A and B")
    else:
        out.append(f"{d.requests} requests: {d.gained} gained, {d.lost} lost, "
                   f"{d.unchanged} unchanged; tokens gained on B: {d.tokens_gained:+d}")
    if d.store is not None:
        out.extend(store_lines(d.store))
    return "\n".join(out)
