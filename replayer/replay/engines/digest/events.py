"""Targeted events still to come, and the state from before a boundary they read.

``reset_prefix_cache`` and ``abort`` act on what the engine holds now, which
the rest of the digest covers. The targeted events (``evict``,
``store_remove``, ``store_fault``) also read what a named request held,
perhaps long before the boundary; a segment that started later cannot know
it. So at a boundary the digest writes every targeted event its replay has
still to run (each side's own part of the trace: an ``evict`` of a request
that arrived before a segment's warm-up is not in that segment's part, and
the lists differ), and for each request they name, what they will read:

* ``evict`` of a request: vLLM's block hashes of that request, which the
  evictor holds from its arrival on (``replay/engines/block_evict.py``), or
  that it has not arrived yet (it then arrives on both sides alike);
* ``store_remove`` and ``store_fault`` (those to come, and faults armed
  that have not fired their last): a key matches a selector by the request
  its name gives, the first request that held its prefix. So for each
  request they name: every block hash it holds by its end (its prompt and
  whole output, hashed by vLLM's own Request and hasher from the part's
  tokens, arrived or not: ``CoreEngine.block_hashes_of``) with the name each
  has now (or none yet), and the puts named by it so far (what a
  ``store_remove`` picks its keys from), in order. A hash named now keeps
  its name; one named by none is named by its next holder on both sides
  alike; so the names the request's keys get are settled. A request not in
  the replay's part (it arrived before the warm-up) is written as such.

A request's names on the segment's side differ from the exact path's
wherever an earlier holder fell before the segment's warm-up (there it is
named by a later one, or by none), and the boundary then fails, as it must.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from replayer.replay.engines.digest.walk import DigestError

TARGETED = ("evict", "store_remove", "store_fault")
_FIELDS = ("at_step", "action", "target", "group", "keys", "op", "code", "times")


@dataclass(frozen=True)
class Pending:
    """What a replay paused at a boundary has still to run: its part's events
    not yet run, and its part's requests as the loop adds them (None: a
    request not in the part)."""

    events: list[dict[str, Any]]
    request: Callable[[str], Any]


def _named_requests(pending: Pending, engine: Any) -> set[str]:
    """Requests the store events to come and the faults still armed name."""
    out = {k["request"] for ev in pending.events
           if ev["action"] in ("store_remove", "store_fault") for k in ev.get("keys") or ()}
    session = getattr(engine, "session", None)
    ops = getattr(session, "ops", None)
    for fault in (ops.faults if ops is not None else ()):
        if fault.fired < fault.times:
            out |= {sel[0] for sel in fault.selectors}
    return out


def _names(engine: Any, rid: str, pending: Pending) -> list[str]:
    """One named request's hashes with their names now, and the puts named by it."""
    boundaries = getattr(engine, "boundaries", None)
    if boundaries is None or engine.session is None:
        raise DigestError(f"a store event names request {rid!r} on an engine with no store "
                          "names, which the digest does not read")
    request = pending.request(rid)
    if request is None:
        return [f"names {rid!r} not in this replay's part"]
    hashes = engine.block_hashes_of(request)
    names = [boundaries.get(bytes(h).hex()) for h in hashes]
    puts = [(r["key"], r["group"], r["boundary"], r["rank"], r["result"])
            for r in engine.session.ops.rows if r["op"] == "put" and r["request"] == rid]
    return [f"names {rid!r} {len(hashes)} hashes named {names!r}",
            f"names {rid!r} puts {puts!r}"]


def events_section(d: Any, engine: Any, pending: Pending | None) -> list[str]:
    """The section's lines: [] where no targeted event is to come or armed."""
    pending = pending or Pending([], lambda rid: None)
    out = []
    evicted: set[str] = set()
    for ev in pending.events:
        if ev["action"] not in TARGETED:
            continue
        out.append("event " + d.enc([ev.get(f) for f in _FIELDS], "events"))
        if ev["action"] == "evict" and ev.get("target") is not None:
            evicted.add(ev["target"])
    evictor = getattr(engine, "evictor", None)
    held = evictor.requests if evictor is not None else {}
    for rid in sorted(evicted):
        req = held.get(rid)
        out.append(f"evict {rid!r} " + ("not arrived" if req is None else
                                        d.enc(list(req.block_hashes), f"evict[{rid!r}]")))
    for rid in sorted(_named_requests(pending, engine)):
        out += _names(engine, rid, pending)
    return out
