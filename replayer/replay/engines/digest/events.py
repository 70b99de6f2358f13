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
  its name gives, the first request that held its prefix. Those names are
  settled only for a request that has finished (a later one files what no
  one filed before it, which a segment's short history cannot tell), so a
  request not yet finished makes the boundary fail. For a finished one: the
  block hashes filed under it and the puts named by it so far (what a
  ``store_remove`` picks its keys from), in order.

A request's names on the segment's side differ from the exact path's
wherever an earlier holder fell before the segment's warm-up, and the
boundary then fails, as it must.
"""

from __future__ import annotations

from typing import Any, Sequence

from replayer.replay.engines.digest.walk import DigestError

TARGETED = ("evict", "store_remove", "store_fault")
_FIELDS = ("at_step", "action", "target", "group", "keys", "op", "code", "times")


def _named_requests(pending: Sequence[dict[str, Any]], engine: Any) -> set[str]:
    """Requests the store events to come and the faults still armed name."""
    out = {k["request"] for ev in pending if ev["action"] in ("store_remove", "store_fault")
           for k in ev.get("keys") or ()}
    session = getattr(engine, "session", None)
    ops = getattr(session, "ops", None)
    for fault in (ops.faults if ops is not None else ()):
        if fault.fired < fault.times:
            out |= {sel[0] for sel in fault.selectors}
    return out


def _names(engine: Any, rid: str) -> list[str]:
    """One finished request's filed hashes and the puts named by it."""
    boundaries = getattr(engine, "boundaries", None)
    if boundaries is None or engine.session is None:
        raise DigestError(f"a store event names request {rid!r} on an engine with no store "
                          "names, which the digest does not read")
    if rid in engine.scheduler.requests or rid not in engine._named:
        raise DigestError(f"a store event to come names request {rid!r}, which this replay "
                          "has not seen finish (it is still to come or running, or arrived "
                          "before this segment's warm-up): which keys its name gives is not "
                          "settled")
    hashes = sorted((h, b) for h, (b, r) in boundaries.items() if r == rid)
    puts = [(r["key"], r["group"], r["boundary"], r["rank"], r["result"])
            for r in engine.session.ops.rows if r["op"] == "put" and r["request"] == rid]
    return [f"names {rid!r} hashes {hashes!r}", f"names {rid!r} puts {puts!r}"]


def events_section(d: Any, engine: Any, pending: Sequence[dict[str, Any]]) -> list[str]:
    """The section's lines: [] where no targeted event is to come or armed."""
    out = []
    evicted: set[str] = set()
    for ev in pending:
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
        out += _names(engine, rid)
    return out
