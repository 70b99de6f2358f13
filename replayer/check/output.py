"""Human-readable output: the run table, the check report, and JSON writing."""

from __future__ import annotations

import json
import tempfile
from collections import deque
from typing import IO, Any, Iterable

from replayer.replay.loop import ReplayResult
from traces.goldens.kind import label
from traces.goldens.outcomes import Mismatch
from traces.model.engine_spec import EngineBlock
from traces.model.gaps import explain_gap, explain_groups
from traces.model.outcome import RequestOutcome
from traces.model.schema import OUTCOME_FIELDS

TABLE_LIMIT = 40


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def run_table(result: ReplayResult, limit: int = TABLE_LIMIT,
              shown_of: "SpooledJson | None" = None) -> str:
    """The run's table; ``shown_of``: the outcomes went to that sink, which kept
    the ones the table shows."""
    cols = ("id", *OUTCOME_FIELDS, "arrival_step", "finish_step")
    heads = ("request", "prompt", "cached", "local", "external", "arrived", "finished")
    if shown_of is None:
        rows = result.requests
        total = len(rows)
        shown = rows if total <= limit else rows[: limit // 2] + rows[-limit // 2:]
    else:
        total, shown = shown_of.count, shown_of.shown()
    cells = [[_fmt(getattr(r, c)) for c in cols] for r in shown]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    line = lambda vals: "  ".join(  # noqa: E731
        v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    out = [line(heads)]
    for k, c in enumerate(cells):
        if total > limit and k == limit // 2:
            out.append(f"... {total - limit} more requests (use --json for all) ...")
        out.append(line(c))
    s = result.summary()
    out.append("")
    out.append(f"engine {result.engine.label}: {s['requests']} requests, "
               f"{s['prompt_tokens']} prompt tokens, {s['cached_tokens']} cached "
               f"(hit rate {s['hit_rate']:.1%}), {s['steps']} steps")
    return "\n".join(out)


def check_report(target: str, engine_key: str, golden_key: str, mismatches: list[Mismatch],
                 result: ReplayResult, engine: EngineBlock, checked: int,
                 store_ok: bool = True, events_ok: bool = True) -> str:
    """The check's first line (PASS, or FAIL when requests, the store or the
    KV-cache events differ), then each mismatch explained."""
    golden_key = label(golden_key)
    if not mismatches:
        verdict, but = ("PASS", "") if store_ok else ("FAIL", ", but the store does not")
        if store_ok and not events_ok:
            verdict, but = "FAIL", ", but the KV-cache events do not"
        total = len(result.requests)
        if checked < total:                         # goldens may name only some requests
            return (f"{verdict} {target}: {checked} of {total} request(s) have goldens for "
                    f"{golden_key}, and they match (engine {engine_key}){but}")
        return (f"{verdict} {target}: {checked} request(s) match the goldens for {golden_key} "
                f"(engine {engine_key}){but}")
    out = [f"FAIL {target}: {len(mismatches)} mismatch(es) against the goldens for "
           f"{golden_key} (engine {engine_key})"]
    by_id = result.by_id()
    first = mismatches[0]
    r = by_id.get(first.request)
    where = (f" (arrived at step {r.arrival_step}, prefill at step {r.prefill_step})"
             if r else " (never arrived)")
    out.append(f"  first divergence: request {first.request}{where}: {first.field} "
               f"expected {_fmt(first.expected)}, got {_fmt(first.actual)}")
    out.append(f"  {'request':<16} {'field':<28} {'expected':>10} {'actual':>10}  note")
    for m in mismatches:
        note = (explain_gap(m.expected, m.actual, engine)
                if isinstance(m.expected, int) and isinstance(m.actual, int) else "")
        out.append(f"  {m.request:<16} {m.field:<28} {_fmt(m.expected):>10} "
                   f"{_fmt(m.actual):>10}  {note}")
    for rid in dict.fromkeys(m.request for m in mismatches):
        why = explain_groups(by_id.get(rid), result.kv_groups)
        if why:
            out.append(f"  why {rid}: {why}")
    return "\n".join(out)


def dumps(result: ReplayResult) -> str:
    """The deterministic JSON form (no timings): byte-identical across runs."""
    return json.dumps(result.as_dict(), indent=2) + "\n"


def _nested(value: Any, level: int) -> str:
    """``value`` as ``json.dumps(indent=2)`` writes it ``level`` levels deep."""
    return json.dumps(value, indent=2).replace("\n", "\n" + "  " * level)


class JsonStream:
    """Writes :func:`dumps`'s bytes as the replay goes, so they are never all in memory.

    Pass it as :func:`replayer.replay.loop.replay`'s ``sink`` (requests are written
    as they are handed on, in arrival order), then :meth:`finish` with the
    result for the rest."""

    def __init__(self, out: IO[str], engine: Any) -> None:
        self.out = out
        self.empty = True
        out.write('{\n  "engine": ' + _nested(engine.as_dict(), 1) + ',\n  "requests": [')

    def __call__(self, outcome: RequestOutcome) -> None:
        self.out.write(("\n    " if self.empty else ",\n    ") + _nested(outcome.as_dict(), 2))
        self.empty = False

    def finish(self, result: ReplayResult) -> None:
        rest = result.as_dict()
        del rest["engine"], rest["requests"]
        self.out.write("]" if self.empty else "\n  ]")
        for key, value in rest.items():
            self.out.write(f",\n  {json.dumps(key)}: " + _nested(value, 1))
        self.out.write("\n}\n")


class SpooledJson:
    """``run --json FILE``'s sink: outcomes go to a spool file as they complete,
    so the replay holds none of them (only the few the run table shows); then
    :meth:`write` puts :func:`dumps`'s bytes into the output (the engine, which
    leads the JSON, is known only once the replay has run)."""

    def __init__(self, limit: int = TABLE_LIMIT) -> None:
        self.spool = tempfile.TemporaryFile("w+", encoding="utf-8")
        self.count = 0
        self.limit = limit
        self._head: list[RequestOutcome] = []
        self._tail: deque[RequestOutcome] = deque(maxlen=limit)

    def __call__(self, outcome: RequestOutcome) -> None:
        # Exactly what JsonStream writes for it.
        self.spool.write(("\n    " if not self.count else ",\n    ")
                         + _nested(outcome.as_dict(), 2))
        self.count += 1
        if len(self._head) < self.limit // 2:
            self._head.append(outcome)
        self._tail.append(outcome)

    def shown(self) -> list[RequestOutcome]:
        """What :func:`run_table` shows: all, or the first and last ``limit // 2``."""
        if self.count <= self.limit:
            return list(self._tail)[-self.count:] if self.count else []
        return self._head + list(self._tail)[-(self.limit // 2):]

    def write(self, path: Any, result: ReplayResult) -> None:
        with open(path, "w", encoding="utf-8") as out:
            stream = JsonStream(out, result.engine)
            self.spool.seek(0)
            while chunk := self.spool.read(1 << 20):
                out.write(chunk)
            stream.empty = not self.count
            stream.finish(result)

    def close(self) -> None:
        self.spool.close()


def lines(items: Iterable[str]) -> str:
    return "\n".join(items)
