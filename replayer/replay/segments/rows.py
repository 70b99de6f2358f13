"""Store operations and KV-cache events, assembled from a segmented replay's owners.

Both name each key or block by the token boundary and first request that
held its prefix: who that was is known only to a replay that saw every
arrival before, which a segment that starts later is not. So a segment's
engine logs every naming of a block hash in order (kept or not:
``start_name_log``) and notes, for each row, the hash it was named by and how
many namings preceded it. The head replays the owners' logs in order, each
over the part it owns (its start boundary to the boundary where the next
owner took over), and names every row from that one map, as the exact path's
``setdefault`` did. After a matched boundary a segment's namings and rows are
the exact path's in the same order (its state, the count of each live
request's named hashes included, is the exact one), so the names come out
as a sequential replay's; only which request a name gives can differ, never
which rows are written (an event's rows are found from its blocks' token
boundaries, the same whoever named them).

Row numbers and engine steps (and the lookups' row ranges) are offset as the
head offsets engine steps; counts (gets checked) are summed over the owned
parts. Store notes are said again from the assembled rows: each segment's
own are of its own replay, warm-up included.
"""

from __future__ import annotations

from typing import Any, Iterator

from replayer.replay.store.codes import NO_AVAILABLE_HANDLE
from replayer.replay.store.recording import key_hash, pressure_note

ZERO = {"rows": 0, "lookups": 0, "names": 0, "gets_checked": 0, "gets_corrupted": 0,
        "faults": 0, "kv_rows": 0, "kv_names": 0}


def _parts(parts: list[tuple[Any, Any]], what: str,
           totals: Any) -> Iterator[tuple[Any, dict, dict, dict]]:
    """Each owner, its part (``what``: the outcome's store or kv_events), and
    the marks where its owned part begins and ends."""
    for o, out in parts:
        part = getattr(out, what)
        if part is None:
            raise RuntimeError(f"a segment handed back no {what} (its engine kept no "
                               "naming log)")
        yield o, part, o.start_marks or ZERO, o.end_marks or totals(part)


class _Names:
    """The exact path's map of block hash -> (boundary, first request), built
    from the owners' logs in order. A prefill/decode pair's instances each
    name by their own first requests: their namings carry the instance's tag
    (``TaggedLog``), and each tag has a map of its own (``maps``)."""

    def __init__(self) -> None:
        self.map: dict[Any, tuple[Any, Any]] = {}
        self.maps: dict[Any, dict[Any, tuple[Any, Any]]] = {None: self.map}
        self.log: list = []
        self.at = 0

    def owner(self, log: list, start: int) -> None:
        self.log, self.at = log, start

    def upto(self, n: int) -> None:
        log, maps = self.log, self.maps
        while self.at < n:
            h, boundary, request, *tag = log[self.at]
            names = maps.setdefault(tag[0] if tag else None, {})
            names.setdefault(h, (boundary, request))
            self.at += 1


class _Faults:
    """Each ``store_fault`` armed, counted as the sequential replay counts it.

    An owner's report lists the faults armed from its warm-up on, in order: a
    suffix of the exact path's list (its part holds every event from its
    warm-up on). Its marks say how many it had armed at its start and end
    boundaries, so its list lines up with the faults assembled so far and its
    own range is known, as its rows' is. A fault still armed at a matched
    boundary is in the next owner's list (the digest writes the armed ones),
    so the last owner holding a fault either ran to the end or saw it fire its
    last before the next one started: its count, and its note of an unused
    fault, are the sequential replay's. Steps are the arming owner's engine
    steps, offset as its rows' are."""

    def __init__(self) -> None:
        self.faults: list[dict] = []
        self.notes_of: list[str | None] = []

    def owner(self, rep: dict, start: int, end: int, shift: int) -> None:
        """``start``, ``end``: how many faults the owner had armed at its start
        and end boundaries; ``shift`` its steps to the exact path's."""
        at = len(self.faults) - start
        for j, f in enumerate(rep["faults"][:end]):
            if j >= start:
                self.faults.append({**f, "step": f["step"] + shift})
                self.notes_of.append(None)
            mine = self.faults[at + j]
            mine["fired"] = f["fired"]
            # Its note as this owner said it, the step made the exact path's.
            tail = f"armed before step {f['step']} fired {f['fired']} of {f['times']} "
            said = [n for n in rep["notes"] if n.startswith(f"store_fault {f['op']} (")
                    and tail in n]
            self.notes_of[at + j] = said[0].replace(
                tail, f"armed before step {mine['step']} fired {f['fired']} of {f['times']} ",
            ) if said and f["fired"] < f["times"] else None

    def report(self) -> list[dict]:
        return self.faults

    def notes(self) -> list[str]:
        """The note of each fault that fired fewer times than armed for."""
        return [n for n in self.notes_of if n is not None]


def assemble_store(parts: list[tuple[Any, Any]]) -> tuple[dict[str, Any] | None, set[str]]:
    """The sequential replay's store report from its owners' parts (each
    ``(owner, outcome)``: the owner's marks and step offset, the outcome's whole
    report with its naming log), and the notes the segments said of their own
    store (the caller leaves those out; the assembled report's are in its
    ``notes``)."""
    if all(out.store is None for _, out in parts):
        return None, set()

    def totals(rep: dict) -> dict[str, int]:
        return {"rows": len(rep["rows"]), "lookups": len(rep["lookups"]),
                "names": len(rep["names"]), "gets_checked": rep["gets_checked"],
                "gets_corrupted": rep["gets_corrupted"], "faults": len(rep["faults"])}

    names = _Names()
    rows: list[dict[str, Any]] = []
    lookups: list[dict[str, Any]] = []
    checked = corrupted = 0
    own_notes: set[str] = set()
    reports = []
    faults = _Faults()
    for o, rep, start, end in _parts(parts, "store", totals):
        shift = o.steps - o.own_steps
        faults.owner(rep, start.get("faults", 0), end.get("faults", len(rep["faults"])), shift)
        reports.append(rep)
        own_notes.update(rep["notes"])
        base = len(rows) - start["rows"]
        names.owner(rep["names"], start["names"])
        for r in rep["rows"][start["rows"]:end["rows"]]:
            r = dict(r)
            names.upto(r.pop("names"))
            by = names.maps.get(r.pop("namer", None), {})
            site = by.get(key_hash(r["key"])) if r["key"] else None
            r["boundary"], r["request"] = site if site else (None, None)
            r["order"] = len(rows)
            r["step"] += shift
            rows.append(r)
        names.upto(end["names"])
        for x in rep["lookups"][start["lookups"]:end["lookups"]]:
            first, last = x["rows"]
            lookups.append({**x, "step": x["step"] + shift, "rows": [first + base, last + base]})
        checked += end["gets_checked"] - start["gets_checked"]
        corrupted += end["gets_corrupted"] - start["gets_corrupted"]
    head = reports[0]
    refused = [r for r in rows if r["op"] == "put" and r["result"] == NO_AVAILABLE_HANDLE]
    notes = faults.notes() + ([] if not refused else [pressure_note(
        head["label"], head["backend"],
        (refused[0]["step"], refused[0]["rank"], refused[0]["key"]), len(refused))])
    return ({"backend": head["backend"], "rows": rows, "lookups": lookups,
             "faults": faults.report(),
             "gets_checked": checked, "gets_corrupted": corrupted, "label": head["label"],
             "notes": notes, "seconds": sum(r["seconds"] for r in reports)}, own_notes)


def assemble_kv_events(parts: list[tuple[Any, Any]]) -> list[dict[str, Any]] | None:
    """The sequential replay's KV-event rows from its owners' parts (each
    outcome's ``kv_events``: its rows, naming log and each row's naming)."""
    if all(out.kv_events is None for _, out in parts):
        return None

    def totals(ev: dict) -> dict[str, int]:
        return {"kv_rows": len(ev["rows"]), "kv_names": len(ev["names"])}

    names = _Names()
    rows: list[dict[str, Any]] = []
    for o, ev, start, end in _parts(parts, "kv_events", totals):
        shift = o.steps - o.own_steps
        names.owner(ev["names"], start["kv_names"])
        named = ev["row_names"]
        for i in range(start["kv_rows"], end["kv_rows"]):
            h, default, upto = named[i]
            names.upto(upto)
            r = dict(ev["rows"][i])
            if h is not None:
                r["boundary"], r["request"] = names.map.get(h, default)
            r["order"] = len(rows)
            r["step"] += shift
            rows.append(r)
        names.upto(end["kv_names"])
    return rows
