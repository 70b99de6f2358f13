"""What the store did for each request, read off the store ops a replay recorded.

Two things ``explain`` cannot see in token counts alone:

* a **store miss** by name: the keys a request's lookup asked for and the
  store did not hold (or a get that failed), by KV-cache group and token
  boundary, so ``store`` lost tokens say which key was missing;
* a **refetch**: attention blocks a request fetched from the store while a
  local copy was resident. A connector that cannot complete a divergent local
  hybrid hit (vLLM's ``supports_divergent_local_hybrid_hits``; MooncakeStore's
  is False) takes the local hit every group agrees on, so when a Mamba group
  stops short locally the store loads again the attention blocks the GPU
  still holds. No token is lost; the cost is tokens and bytes moved.

Both read the ``store_ops`` rows (the ``--store-ops`` table: op, key group,
token boundary, bytes, result, the request that loaded it) and each
request's lookup (the rows it made) and per-group local hits (vLLM's
``find_longest_cache_hit_per_group``); nothing here re-implements the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traces.model.store_codes import code_name

#: Groups whose blocks are KV of their own tokens (a refetch moves them again);
#: a Mamba group's key is one state at its boundary, not a span of tokens.
SPAN_KINDS = ("full_attention", "sliding_window", "mla")
#: A CPU tier's lookup rows beside HIT (1) and MISS (0): vLLM's LookupResult as
#: the offloading connector files it (``LOOKUP_CODES`` in connector/offloading_0_33.py).
HIT_PENDING, RETRY = 2, 3


@dataclass(frozen=True)
class StoreMiss:
    """One key a request needed from the store and did not get."""

    op: str            # "lookup" (not in the store) or "get" (the load failed)
    group: int | None
    boundary: int | None
    result: int
    how: str = ""      # what became of a key that was written: "removed at step 3"

    def said(self, kinds: dict[int, str]) -> str:
        where = (f"group {self.group} ({kinds.get(self.group, '?')})"
                 if self.group is not None else "a key of no group")
        at = f" @ {self.boundary}" if self.boundary is not None else ""
        if self.op == "get":
            return f"{where}{at}: its get returned {code_name(self.result)}"
        if self.result == HIT_PENDING:
            return f"{where}{at} was still being stored (HIT_PENDING: not yet readable)"
        if self.result == RETRY:
            return f"{where}{at} was not ready to look up (RETRY)"
        if self.how:
            return f"{where}{at} was written and is gone ({self.how})"
        return f"{where}{at} was never written (the first key past the store's hit)"


@dataclass(frozen=True)
class Refetch:
    """Tokens (and the bytes of the blocks holding them) fetched while resident."""

    tokens: int
    bytes: int
    groups: tuple[int, ...]
    local: int                         # the request's local hit (all groups agree)
    resident: dict[int, int]           # group -> what it alone held locally

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "bytes": self.bytes, "groups": list(self.groups),
                "local": self.local,
                "resident": {str(g): h for g, h in sorted(self.resident.items())}}


def _kinds(result: Any) -> dict[int, str]:
    return {g["group"]: g["kind"] for g in (result.kv_groups or [])}


def _gone(rows: list[dict[str, Any]], upto: int) -> dict[str, str]:
    """Key -> what removed it, for keys written before row ``upto`` and gone by then."""
    written: set[str] = set()
    gone: dict[str, str] = {}
    for r in rows[:upto]:
        op, key = r["op"], r["key"]
        if op == "put" and r["result"] is not None and r["result"] >= 0:
            written.add(key)
            gone.pop(key, None)
        elif op in ("remove", "evict") and key in written:
            gone[key] = f"{'removed' if op == 'remove' else 'evicted'} at step {r['step']}"
        elif op == "remove_all":
            gone.update({k: f"the store emptied at step {r['step']}" for k in written})
    return gone


def _lookup_misses(rows: list[dict[str, Any]], lookup: dict[str, Any]) -> list[StoreMiss]:
    """The keys one lookup found missing that had been written (in each group,
    the lowest boundary); else those a CPU tier was still storing (HIT_PENDING)
    or told it to retry; else, in each group, the first missing key past its hit."""
    lo, hi = lookup["rows"]
    gone = _gone(rows, lo)
    missing = [r for r in rows[lo:hi] if r["op"] == "lookup" and r["result"] != 1]
    written = [r for r in missing if r["key"] in gone]
    past = [r for r in missing if (r["boundary"] or 0) > lookup["hit_length"]]
    pick = written or [r for r in past if r["result"] in (HIT_PENDING, RETRY)] or past
    first: dict[int | None, dict[str, Any]] = {}
    for r in pick:
        have = first.get(r["group"])
        if have is None or (r["boundary"] or 0) < (have["boundary"] or 0):
            first[r["group"]] = r
    return [StoreMiss("lookup", r["group"], r["boundary"], int(r["result"]),
                      gone.get(r["key"], ""))
            for r in sorted(first.values(), key=lambda r: (r["boundary"] or 0, r["group"] or 0))]


def store_misses(result: Any, request_ids: list[str]) -> dict[str, list[StoreMiss]]:
    """Per request: what its last store lookup missed (:func:`_lookup_misses`),
    and every get of its load that failed."""
    store = result.store
    if not store:
        return {}
    rows = store["rows"]
    last = {x["request"]: x for x in store["lookups"]}
    wanted = set(request_ids)
    out: dict[str, list[StoreMiss]] = {}
    for rid, x in last.items():
        if rid in wanted and "rows" in x:
            found = _lookup_misses(rows, x)
            if found:
                out[rid] = found
    for r in rows:
        if r["op"] == "get" and r["loader"] in wanted and r["result"] is not None \
                and r["result"] < 0:
            out.setdefault(r["loader"], []).append(
                StoreMiss("get", r["group"], r["boundary"], int(r["result"])))
    return out


def _span(boundary: int, block: int) -> tuple[int, int]:
    """The tokens a key at ``boundary`` holds: its block, up to the boundary
    (a key at a prompt's tail, B + H, ends inside its block)."""
    return (boundary - 1) // block * block, boundary


def refetched(result: Any, block_size: dict[int, int]) -> dict[str, Refetch]:
    """Per request: attention tokens its store load fetched that its own group
    held locally (above the local hit, below that group's local hit), and the
    bytes of the blocks fetched for them. ``block_size``: group -> tokens."""
    store = result.store
    if not store:
        return {}
    kinds = _kinds(result)
    by_id = result.by_id()
    out: dict[str, Refetch] = {}
    acc: dict[str, list[int]] = {}
    groups: dict[str, set[int]] = {}
    counted: set[tuple[str, int, int]] = set()
    for r in store["rows"]:
        if r["op"] != "get" or r["result"] is None or r["result"] < 0:
            continue
        g, b, rid = r["group"], r["boundary"], r["loader"]
        if rid not in by_id or g is None or b is None or kinds.get(g) not in SPAN_KINDS:
            continue
        req = by_id[rid]
        hits = req.group_hits
        if not hits or g >= len(hits):
            continue
        local = int(req.num_local_cached_tokens or 0)
        start, end = _span(b, block_size.get(g, b))
        held = min(end, int(hits[g])) - max(start, local)
        if held > 0:
            tok_bytes = acc.setdefault(rid, [0, 0])
            if (rid, g, b) not in counted:        # each rank fetches its own copy: bytes
                counted.add((rid, g, b))           # add up, tokens count once
                tok_bytes[0] += held
            tok_bytes[1] += int(r["bytes"] or 0)
            groups.setdefault(rid, set()).add(g)
    for rid, (tokens, nbytes) in acc.items():
        req = by_id[rid]
        out[rid] = Refetch(tokens, nbytes, tuple(sorted(groups[rid])),
                           int(req.num_local_cached_tokens or 0),
                           {g: int(req.group_hits[g]) for g in groups[rid]})
    return out
