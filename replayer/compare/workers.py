"""The real worker held to the null executor: one trace, both workers, what differs.

The null executor is what every golden of this project was recorded with; the
model worker (``--worker model``) runs vLLM's own model runner over real KV
tensors. On the same vLLM both must give the same schedule and the same hits,
so :func:`worker_differences` compares everything the scheduler decides, not
only what goldens pin: per request the prefill fields (hit, local/external
split), the step it was prefilled in and the step it finished in; the store's
operations (step, key, result) and the scheduler's store lookups where a
connector runs; vLLM's KV-cache events where the trace
collects them. An empty list is agreement; anything else is a finding.
"""

from __future__ import annotations

from typing import Any

from replayer.replay.loop import ReplayResult

SCHEDULE_FIELDS = ("prefill_step", "finish_step", "aborted")


def _request_fields(r: Any) -> dict[str, Any]:
    return {**r.observed(), **{f: getattr(r, f) for f in SCHEDULE_FIELDS}}


def _store_op(row: dict[str, Any]) -> tuple[Any, ...]:
    """A store operation as both workers must agree on it: step, rank, op, key,
    result, the request whose load read it and (a prefill/decode pair) the
    instance whose client made it. A successful get answers the
    bytes it read, which are the page sizes of each worker's KV cache (the null
    executor's placeholder pages, the tiny model's layers), so a get compares by
    success, or by its error code; ``bytes`` differs for the same reason."""
    result = row["result"]
    if row["op"] == "get" and result is not None and result >= 0:
        result = "read"
    return (row["step"], row["rank"], row["op"], row["key"], result, row.get("loader"),
            row.get("instance"))


def worker_differences(null: ReplayResult, model: ReplayResult) -> list[str]:
    """One line per difference between a null-executor and a model-worker replay."""
    out: list[str] = []
    a, b = null.by_id(), model.by_id()
    if list(a) != list(b):
        out.append(f"requests differ: {sorted(set(a) ^ set(b))[:5]}")
    for rid in a:
        if rid not in b:
            continue
        x, y = _request_fields(a[rid]), _request_fields(b[rid])
        for field, value in x.items():
            if y[field] != value:
                out.append(f"request {rid}: {field} null {value}, model {y[field]}")
    if null.steps != model.steps:
        out.append(f"engine steps: null {null.steps}, model {model.steps}")
    if (null.store is None) != (model.store is None):
        out.append("store: one side ran a connector, the other did not")
    elif null.store is not None and model.store is not None:
        ka = [_store_op(r) for r in null.store["rows"]]
        kb = [_store_op(r) for r in model.store["rows"]]
        if ka != kb:
            first = next(i for i, (p, q) in enumerate(zip(ka + [None], kb + [None])) if p != q)
            out.append(f"store operations differ from operation {first} on "
                       f"(null {len(ka)}, model {len(kb)})")
        la, lb = null.store["lookups"], model.store["lookups"]
        if la != lb:
            first = next(i for i, (p, q) in enumerate(zip(la + [None], lb + [None])) if p != q)
            out.append(f"store lookups differ from lookup {first} on "
                       f"(null {len(la)}, model {len(lb)})")
    if null.kv_events != model.kv_events:
        out.append(f"KV-cache events differ (null {len(null.kv_events or [])} rows, "
                   f"model {len(model.kv_events or [])})")
    return out
