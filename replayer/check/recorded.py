"""Replaying a recording and comparing it with what the recording itself saw.

``replayer check --against recorded TRACE`` replays a recorded trace with the
recorder installed (:mod:`replayer.recorder`) into a scratch directory, so
the replay's observations come out in exactly the recording's tables, and
compares them table by table: per-request outcomes, the schedule (steps),
and the store's keys. It is the first check to run on a new recording: a
difference means the replay does not reproduce production, before any
golden is looked at.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from replayer.replay.engines.sources.specs import INSTALLED
from replayer.replay.execution.clients import replay_on
from replayer.replay.loop import ReplayResult
from traces import Trace
from traces.model.errors import TraceError
from traces.model.schema import OUTCOME_FIELDS
from traces.trace import read_trace

# Store operations compared by key (puts, gets, lookups); their order across a
# worker's threads and the step a put completes in are not the replay's to pin.
STORE_OPS_COMPARED = ("lookup", "put", "get")
MAX_LINES = 10


def record_replay(trace: Trace, out_dir: str | Path, store: Any = None,
                  spec: Any = INSTALLED) -> ReplayResult:
    """Replay ``trace`` on ``spec`` (the installed vLLM, or a release the recorder
    hooks: 0.32) with the recorder writing to ``out_dir``."""
    from replayer.recorder.install import recording_into

    return replay_on(trace, spec, store=store, recorder=recording_into(str(out_dir)))


def _rows(table, cols: tuple[str, ...]) -> list[tuple]:
    if table is None:
        return []
    data = [table[c].to_pylist() if c in table.column_names else [None] * table.num_rows
            for c in cols]
    return list(zip(*data))


def _op_outcome(row: tuple) -> tuple:
    """A store op as compared: a get's result is the bytes it read, which depend on
    the model's KV layout; the replay's null model (a seam) has KV tensors of its
    own size, so a get is compared by what it did (read: 1, nothing: 0, an error
    code: itself), every other op by its result; keys without the model's name;
    each on the worker rank that did it (a recording before ranks: rank 0)."""
    op, key, group, result, rank = row
    if op == "get" and result is not None and result > 0:
        result = 1
    return (op, _keyed_by_rest(key), group, result, rank or 0)


def _keyed_by_rest(key: str | None) -> str | None:
    """A store key without its first field, the served model's directory name
    (``tiny-qwen3-next@tp_rank:0@...@group:G@<hash>``): the replay's model is a
    seam of its own, so keys are compared on ranks, group and block hash."""
    if key is None or "@" not in key:
        return key
    return "*@" + key.split("@", 1)[1]


def _chunks(table) -> dict[str, list[tuple]]:
    per: dict[str, list[tuple]] = {}
    for _, rid, n, acc in _rows(table, ("step", "id", "num_scheduled_tokens",
                                        "num_accepted_tokens")):
        per.setdefault(rid, []).append((n, acc))
    return per


def load_shifted(recorded: Trace, fresh: Trace) -> int:
    """Requests a live server scheduled later than the replay, with every request's
    chunks the same: with a KV connector that loads asynchronously, a request waits
    for its store load on the worker's clock (a thread finishing a copy), which no
    replay reproduces step for step. 0 when the schedules differ otherwise, or the
    trace has no connector."""
    if not recorded.engine.connector or recorded.steps is None or fresh.steps is None:
        return 0
    if _chunks(recorded.steps) != _chunks(fresh.steps):
        return 0
    first = lambda t: {rid: step for step, rid in  # noqa: E731
                       reversed(_rows(t, ("step", "id")))}
    a, b = first(recorded.steps), first(fresh.steps)
    return sum(1 for rid in a if a[rid] != b.get(rid))


def upto(table, cut: int | None, col: str = "step"):
    """``table``'s rows of steps up to ``cut`` (all of them when ``cut`` is None)."""
    if table is None or cut is None or col not in table.column_names:
        return table
    return table.filter(pc.less_equal(table[col], cut))


def whole_outcomes(trace: Trace, cut: int | None) -> dict[str, tuple]:
    """Outcome rows compared: all of them, or in a recording cut short those its
    tables hold whole (carried by a step up to the cut, the request's own row kept)."""
    cols = ("id", *OUTCOME_FIELDS)
    rows = {r[0]: r for r in _rows(upto(trace.outcomes, cut), cols)}
    if cut is not None:
        known = set(trace.requests["id"].to_pylist())
        rows = {rid: r for rid, r in rows.items() if rid in known}
    return rows


def cut_requests(recorded: Trace) -> list[str]:
    """Requests a recording cut short does not hold whole: every id it has a row of
    (request, step or outcome) whose outcome is not compared."""
    if recorded.cut_step is None:
        return []
    ids: set[str] = set(recorded.requests["id"].to_pylist())
    for table in (recorded.outcomes, recorded.steps):
        if table is not None:
            ids.update(table["id"].to_pylist())
    return sorted(ids - whole_outcomes(recorded, recorded.cut_step).keys())


def cut_line(recorded: Trace) -> str:
    """The one line on a recording cut short: from which step, and how many
    requests the check left out or compared only up to it."""
    lost = cut_requests(recorded)
    gone = set(lost)
    running = sum(1 for rid in recorded.running_at_end if rid not in gone)
    named = f" ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''})" if lost else ""
    return (f"the recording was cut short (no clean stop) after step {recorded.cut_step}: "
            f"{len(lost)} request(s) not compared, prefilled after it or with rows lost"
            f"{named}; {running} more still running, compared up to it")


def compare(recorded: Trace, fresh: Trace) -> list[str]:
    """Differences between a recording and a replay of it, one line each. A
    recording cut short is compared up to its cut (``Trace.cut_step``)."""
    diffs: list[str] = []
    cut = recorded.cut_step
    want, got = whole_outcomes(recorded, cut), whole_outcomes(fresh, cut)
    for rid, row in want.items():
        other = got.get(rid)
        if other is None:
            diffs.append(f"outcome of {rid}: recorded, but the replay never prefilled it")
            continue
        for name, a, b in zip(OUTCOME_FIELDS, row[1:], other[1:]):
            if a != b:
                diffs.append(f"outcome of {rid}: {name} recorded {a}, replayed {b}")
    for rid in got.keys() - want.keys():
        diffs.append(f"outcome of {rid}: replayed, but not in the recording")
    if recorded.steps is not None:
        scols = ("step", "id", "num_scheduled_tokens", "num_accepted_tokens")
        a, b = _rows(upto(recorded.steps, cut), scols), _rows(upto(fresh.steps, cut), scols)
        if a != b and not load_shifted(recorded, fresh):
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            x = a[first] if first < len(a) else None
            y = b[first] if first < len(b) else None
            diffs.append(f"steps: {len(a)} recorded rows, {len(b)} replayed; first difference at "
                         f"row {first}: recorded {x}, replayed {y}")
    diffs += _compare_kv_events(recorded, fresh)
    if recorded.store_ops is not None:
        ocols = ("op", "key", "group", "result", "rank")
        keep = lambda rows: Counter(_op_outcome(r) for r in rows  # noqa: E731
                                    if r[0] in STORE_OPS_COMPARED)
        a = keep(_rows(upto(recorded.store_ops, cut), ocols))
        b = keep(_rows(upto(fresh.store_ops, cut), ocols))
        if (recorded.header.get("source") or {}).get("anonymized"):
            a = Counter((op, g, r, k) for (op, _, g, r, k), n in a.items() for _ in range(n))
            b = Counter((op, g, r, k) for (op, _, g, r, k), n in b.items() for _ in range(n))
        for row, n in sorted((a - b).items(), key=str)[:MAX_LINES]:
            diffs.append(f"store: recorded {row[0]} {row[1:-1]} x{n} on rank {row[-1]} "
                         "not in the replay")
        for row, n in sorted((b - a).items(), key=str)[:MAX_LINES]:
            diffs.append(f"store: replayed {row[0]} {row[1:-1]} x{n} on rank {row[-1]} "
                         "not in the recording")
    return diffs


def _compare_kv_events(recorded: Trace, fresh: Trace) -> list[str]:
    """The KV-cache events, block by block in published order (hashes too, unless
    the recording was anonymised)."""
    if recorded.kv_events is None:
        return []
    cols = ("step", "event", "group", "boundary", "kept", "request")
    if not (recorded.header.get("source") or {}).get("anonymized"):
        cols += ("hash",)
    order = lambda t: t.sort_by("order") if t is not None else None  # noqa: E731
    cut = recorded.cut_step
    a = _rows(order(upto(recorded.kv_events, cut)), cols)
    b = _rows(order(upto(fresh.kv_events, cut)), cols)
    if a == b:
        return []
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x = a[first] if first < len(a) else None
    y = b[first] if first < len(b) else None
    return [f"kv_events: {len(a)} recorded block(s), {len(b)} replayed; first difference at "
            f"row {first}: recorded {x}, replayed {y}"]


def check_against_recorded(trace: Trace, store: Any = None,
                           spec: Any = INSTALLED) -> tuple[list[str], bool, ReplayResult]:
    """Replay a recorded trace and compare; (report lines, matched, the replay)."""
    if trace.outcomes is None:
        raise TraceError(trace.path or "trace", "has no outcomes table: --against recorded "
                                                "needs a recorded trace")
    scratch = Path(tempfile.mkdtemp(prefix="replayer-fidelity-"))
    try:
        result = record_replay(trace, scratch / "trace", store=store, spec=spec)
        fresh = read_trace(scratch / "trace")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    diffs = compare(trace, fresh)
    cut = trace.cut_step
    n_out = len(whole_outcomes(trace, cut))
    parts = [f"{n_out} outcome(s)"]
    if trace.steps is not None:
        parts.append(f"{upto(trace.steps, cut).num_rows} step row(s)")
    if trace.store_ops is not None:
        parts.append(f"{upto(trace.store_ops, cut).num_rows} store op(s)")
    if trace.kv_events is not None:
        parts.append(f"{upto(trace.kv_events, cut).num_rows} kv event block(s)")
    shifted = load_shifted(trace, fresh)        # > 0: some first step moved
    if shifted:
        parts.append(f"the same chunks per request, {shifted} request(s) first scheduled at "
                     "another step (waiting on an asynchronous store load)")
    what = ", ".join(parts)
    if cut is not None:
        what += " up to step " + str(cut)
    lines = [] if not diffs else [
        f"replay differs from the recording ({what}): {len(diffs)} difference(s)"]
    lines += [f"  {d}" for d in diffs[:MAX_LINES]]
    if len(diffs) > MAX_LINES:
        lines.append(f"  ... {len(diffs) - MAX_LINES} more")
    if not diffs:
        lines.append(f"replay matches the recording: {what}")
    if cut is not None:
        lines.append(cut_line(trace))
    elif diffs and (trace.skipped_parts or trace.notes):
        lines.append("  (the recording was cut short: each table lost its last unflushed "
                     "rows, so differences near its end are expected)")
    return lines, not diffs, result
