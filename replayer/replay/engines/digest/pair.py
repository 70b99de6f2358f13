"""A prefill/decode pair's state digest: both engines and the store they share.

A pair (``engine.prefill_instance``, :mod:`replayer.replay.engines.connector.pd_pair`)
is two engines stepped as one over one store and one log of store
operations. What its future depends on is each instance's whole state, the
store once, and the hand-off between them. So its sections are the decode
instance's, as one engine's (its store section holds the shared store and
log, and its own connector), and one more, ``pair``: the prefill instance's
every section (its scheduler, block pool, requests, and its connector:
each line under its section's name), and the pair's own hand-off (the
requests waiting at the prefill instance and those prefilled and due at the
decode instance, in order).

Targeted store events (``store_remove``, ``store_fault``) select keys by the
first request that held their prefix, and each instance names its own keys
by its own first requests; the events section reads one engine's names. So a
pair with a store event to come, or a fault still armed, is not digested
(the boundary is never trusted); an ``evict`` is the decode instance's and
is read there.
"""

from __future__ import annotations

from typing import Any, Callable

from replayer.replay.engines.digest import events as digest_events
from replayer.replay.engines.digest.walk import DigestError

_OWN = "walked in a section of its own"

EXCLUDED: dict[str, dict[str, str]] = {
    "PrefillDecodePair": {
        "prefill": "the prefill instance: written in the pair section",
        "decode": "the decode instance: the digest's other sections",
        "info": "configuration: the decode instance's engine info",
        "dropped": "configuration: the decode instance's settings a release lacks",
        "notes": "said at the end, merged from every segment; no decision reads them",
        "_steps": "the pair's step clock from its start (the loop's clock is compared)",
        "_waiting": _OWN + " (the pair section: request ids in order; each request is "
                           "the part's, built from the trace)",
        "_ready": _OWN + " (the pair section: request ids in order)"},
}


def pair_sections(pair: Any, pending: Any,
                  one: Callable[[Any, Any, str], dict[str, list[str]]],
                  digest: Any) -> dict[str, list[str]]:
    """The pair's sections. ``one(engine, pending, pair_part)`` writes one
    instance's sections (the release's ``state_sections``); ``digest`` is a
    fresh walk for the pair's own fields."""
    if digest_events._named_requests(pending or digest_events.Pending([], lambda r: None),
                                     pair.decode):
        raise DigestError("a prefill/decode pair with a store event to come or a fault "
                          "armed: each instance names its keys by its own first requests, "
                          "and the events section reads one engine's names")
    out = one(pair.decode, pending, "decode")
    prefill = one(pair.prefill, None, "prefill")
    lines = [digest.obj(pair, "pair"),
             "waiting " + digest.enc(list(pair._waiting), "pair._waiting"),
             "ready " + digest.enc([r.id for r in pair._ready], "pair._ready")]
    for name, section in prefill.items():
        if name != "clock":                 # the loop's, in the decode instance's sections
            lines += [f"prefill.{name} {line}" for line in section]
    out["pair"] = lines
    return out
