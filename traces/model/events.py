"""Engine-level events a trace can hold: what each action takes, and its one check.

Actions: ``reset_prefix_cache``; ``abort`` of a request (``target``);
``evict`` of cached GPU blocks, one request's (``request``) or one KV-cache
group's (``group``, vLLM's group index as ``--json``'s ``kv_groups`` and the
store goldens number them) or one group's blocks of one request (both);
``store_remove`` of MooncakeStore keys named by meaning (``keys``: each
``{request, group?, boundary?, rank?}`` as the store goldens name keys: the
first request whose prompt holds the prefix, the group, the token boundary,
and the worker rank that wrote it, so one rank's shard can be lost; a field
left out matches every value); ``store_fault``: from then on, the next
``times`` (1) store ops ``op`` (put, get, exists, lookup) on keys matching
``keys`` return Mooncake error ``code`` (a name such as ``RPC_FAIL`` or a
number; default RPC_FAIL) instead of reaching the store, so vLLM's own error
handling decides what follows (a miss, a shorter hit, a put skipped).

A scenario spells an evict's request as ``request:``; the events table keeps
it in ``target`` (the request an event applies to), beside ``group`` and
``keys``. Both paths check rows here, so a scenario and its trace directory
refuse the same things; scenario messages name ``events[i]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traces.model.errors import TraceError, reject_unknown_keys, require_int
from traces.model.store_codes import CORRUPT, RPC_FAIL, code_of

ACTIONS = ("reset_prefix_cache", "abort", "evict", "store_remove", "store_fault")
YAML_KEYS = ("after", "at_step", "action", "target", "request", "group", "keys",
             "op", "code", "times")
FAULT_OPS = ("put", "get", "exists", "lookup")
SELECTOR_KEYS = ("request", "group", "boundary", "rank")
# The optional fields each action takes, by their scenario names.
TAKES: dict[str, tuple[str, ...]] = {
    "reset_prefix_cache": (), "abort": ("target",), "evict": ("request", "group"),
    "store_remove": ("keys",), "store_fault": ("keys", "op", "code", "times")}


def parse_event(path: Path, where: str, ev: dict[str, Any], ids: set[str]) -> dict[str, Any]:
    """One scenario event as an events-table row (checked; errors name ``where``)."""
    reject_unknown_keys(path, where, ev, YAML_KEYS)
    action = ev.get("action")
    if action not in ACTIONS:
        raise TraceError(path, f"{where}.action must be one of {', '.join(ACTIONS)}, "
                               f"got {action!r}")
    takes = TAKES[action]
    for key in ("target", "request", "group", "keys", "op", "code", "times"):
        if key in ev and key not in takes:
            said = f"takes {', '.join(takes)}" if takes else "takes nothing more"
            raise TraceError(path, f"{where}.{key} does not apply to action {action} ({said})")
    at = ev.get("at_step")
    if at is not None:
        at = require_int(path, f"{where}.at_step", at, 0)
    row: dict[str, Any] = {"after": None if ev.get("after") is None else str(ev["after"]),
                           "at_step": at, "action": action, "target": None,
                           "group": None, "keys": None, "op": None, "code": None,
                           "times": None}
    if action == "abort":
        row["target"] = None if ev.get("target") is None else str(ev["target"])
    elif action == "evict":
        if ev.get("request") is None and ev.get("group") is None:
            raise TraceError(path, f"{where}: evict needs request: ID, group: G, or both")
        if ev.get("request") is not None:
            row["target"] = _known(path, f"{where}.request", ev["request"], ids)
        if ev.get("group") is not None:
            row["group"] = require_int(path, f"{where}.group", ev["group"], 0)
    elif action == "store_remove":
        row["keys"] = _selectors(path, f"{where}.keys", ev.get("keys"), ids)
    elif action == "store_fault":
        row["keys"] = _selectors(path, f"{where}.keys", ev.get("keys"), ids)
        if ev.get("op") not in FAULT_OPS:
            raise TraceError(path, f"{where}.op must be one of {', '.join(FAULT_OPS)}, "
                                   f"got {ev.get('op')!r}")
        row["op"] = ev["op"]
        code = code_of(ev.get("code", RPC_FAIL))
        if code is None:
            raise TraceError(path, f"{where}.code must be a Mooncake error code (a name such "
                                   f"as RPC_FAIL or a number below 0), got {ev.get('code')!r}")
        if code == CORRUPT and ev["op"] != "get":
            raise TraceError(path, f"{where}.code CORRUPT is a get's (it reads another key's "
                                   f"bytes), not a {ev['op']}'s")
        row["code"] = code
        row["times"] = require_int(path, f"{where}.times", ev.get("times", 1), 1)
    return row


def _known(path: Path, where: str, rid: Any, ids: set[str]) -> str:
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) not in ids:
        raise TraceError(path, f"{where} names unknown request {rid!r}")
    return str(rid)


def _selectors(path: Path, where: str, keys: Any, ids: set[str]) -> list[dict[str, Any]]:
    if not isinstance(keys, list) or not keys:
        raise TraceError(path, f"{where} must be a non-empty list of "
                               "{request, group?, boundary?, rank?}")
    out = []
    for j, sel in enumerate(keys):
        w = f"{where}[{j}]"
        if not isinstance(sel, dict):
            raise TraceError(path, f"{w} must be a mapping "
                                   "{{request, group?, boundary?, rank?}}")
        reject_unknown_keys(path, w, sel, SELECTOR_KEYS)
        if sel.get("request") is None:
            raise TraceError(path, f"{w} needs request: the first request whose prompt "
                                   "holds the key's prefix")
        out.append({"request": _known(path, f"{w}.request", sel["request"], ids),
                    "group": None if sel.get("group") is None
                    else require_int(path, f"{w}.group", sel["group"], 0),
                    "boundary": None if sel.get("boundary") is None
                    else require_int(path, f"{w}.boundary", sel["boundary"], 1),
                    "rank": None if sel.get("rank") is None
                    else require_int(path, f"{w}.rank", sel["rank"], 0)})
    return out


def check_event_row(path: Path, row: int, ev: dict[str, Any], ids: set[str]) -> None:
    """An events-table row's action-specific fields (a trace directory's events.parquet)."""
    action = ev["action"]
    if action == "abort" and ev.get("target") not in ids:
        raise TraceError(path, f"abort of unknown request {ev.get('target')!r}",
                         column="target", row=row)
    if action == "evict":
        if ev.get("target") is None and ev.get("group") is None:
            raise TraceError(path, "evict needs a target request, a group, or both",
                             column="target", row=row)
        if ev.get("target") is not None and ev["target"] not in ids:
            raise TraceError(path, f"evict of unknown request {ev['target']!r}",
                             column="target", row=row)
        if ev.get("group") is not None and ev["group"] < 0:
            raise TraceError(path, f"evict of group {ev['group']} (must be >= 0)",
                             column="group", row=row)
    if action == "store_fault":
        if ev.get("op") not in FAULT_OPS:
            raise TraceError(path, f"store_fault op must be one of {', '.join(FAULT_OPS)}, "
                                   f"got {ev.get('op')!r}", column="op", row=row)
        if ev.get("code") is None or ev["code"] >= 0:
            raise TraceError(path, f"store_fault code must be below 0, got {ev.get('code')!r}",
                             column="code", row=row)
        if ev.get("times") is None or ev["times"] < 1:
            raise TraceError(path, f"store_fault times must be 1 or more, got "
                                   f"{ev.get('times')!r}", column="times", row=row)
    if action in ("store_remove", "store_fault"):
        keys = ev.get("keys")
        if not keys:
            raise TraceError(path, f"{action} needs keys", column="keys", row=row)
        for sel in keys:
            if sel.get("request") not in ids:
                raise TraceError(path, f"{action} names unknown request "
                                       f"{sel.get('request')!r}", column="keys", row=row)
            if (sel.get("group") is not None and sel["group"] < 0) or (
                    sel.get("boundary") is not None and sel["boundary"] < 1) or (
                    sel.get("rank") is not None and sel["rank"] < 0):
                raise TraceError(path, f"{action} key {sel} has a group < 0, a "
                                       "boundary < 1 or a rank < 0", column="keys", row=row)
