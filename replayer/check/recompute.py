"""``check --recompute``: does every prefix-cache hit give what a recompute gives?

A hit is worth its count only if the KV blocks and the Mamba/linear-attention
state it resumes from are the ones a recompute would have produced. On the
model worker (``--worker model``) the replay reports, per request, the model's
logprob of each of its output tokens (forced to the trace's). This module
replays every request that had a hit (local or from the store) again, cold:
in a fresh engine, entering at the step it entered before, its prompt salted with a cache salt of its own so that
no cached block or store key can serve it, with the same forced tokens, the
same model and the same engine geometry. Where the hit was right, both give the
same logprobs up to the float rounding of a different prefill chunking; where
it was wrong, they differ.

The tolerance is measured, not guessed (:func:`calibrate`): the same cold
recompute run a second time with another chunking (``max_num_batched_tokens``
halved), and the largest logprob difference between the two on this
machine. A hit resumes through other code (other chunk boundaries, a window's
blocks skipped, another batch) whose float rounding is of the same size, a few
float32 units in the last place of the logprob, so the threshold is
:data:`MARGIN` times the tolerance, and never below :data:`FLOOR_ULPS` units in
the last place of the largest logprob (two computations that happen to agree
bit for bit measure 0). A hit whose logprobs differ from its recompute by more
is a **wrong hit**, named with what served it (its hit, local or from the
store, each group's own reach, the store keys loaded for it), the first output
position that diverged and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from replayer.check.divergence import FLOOR_ULPS, MARGIN, max_diff, threshold_for
from replayer.check.reference import calibrate
from replayer.replay.loop import ReplayResult
from traces import Trace



@dataclass
class Verdict:
    """One hit request: its logprobs beside its recompute's."""

    id: str
    num_cached_tokens: int
    num_external_cached_tokens: int
    divergence: float                  # largest |logprob - recompute's| over its outputs
    first_position: int | None         # first output index beyond the tolerance
    wrong: bool
    group_hits: list[int] | None = None
    store_keys: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "num_cached_tokens": self.num_cached_tokens,
                "num_external_cached_tokens": self.num_external_cached_tokens,
                "divergence": self.divergence, "first_position": self.first_position,
                "verdict": "wrong hit" if self.wrong else "matches recompute",
                **({"group_hits": self.group_hits} if self.group_hits is not None else {}),
                **({"store_keys": self.store_keys} if self.store_keys else {})}


@dataclass
class RecomputeReport:
    tolerance: float                   # the calibrated tolerance
    calibration_chunks: tuple[int, int]
    verdicts: list[Verdict]
    threshold: float = 0.0

    @property
    def wrong(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.wrong]

    def as_dict(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "threshold": self.threshold,
                "calibration_max_num_batched_tokens": list(self.calibration_chunks),
                "hits": [v.as_dict() for v in self.verdicts]}


def hit_requests(result: ReplayResult) -> list[str]:
    """Requests that resumed from a cached prefix and produced tokens, in arrival order."""
    return [r.id for r in result.requests
            if (r.num_cached_tokens or 0) > 0 and r.logprobs and not r.aborted]


def store_keys_loaded(result: ReplayResult, rid: str) -> list[dict[str, Any]]:
    """Store keys read back for ``rid`` (the gets its load ran: ``loader``; a key's
    ``request`` is the first request that held its prefix), with their group and
    boundary, where the replay had a connector."""
    if result.store is None:
        return []
    return [{"key": r["key"], "group": r["group"], "boundary": r["boundary"]}
            for r in result.store["rows"]
            if r["op"] == "get" and (r.get("loader") or r.get("request")) == rid
            and r["result"] >= 0]


def recompute_check(trace: Trace, result: ReplayResult,
                    replay: Callable[[Trace], ReplayResult]) -> RecomputeReport:
    """Every hit of ``result`` (a model-worker replay of ``trace``) held to its cold
    recompute; ``replay`` replays a trace on the same engine and worker."""
    ids = hit_requests(result)
    if not ids:
        return RecomputeReport(0.0, (0, 0), [])
    arrivals = {r.id: r.arrival_step for r in result.requests}
    cold, tolerance, chunks = calibrate(trace, ids, replay, arrivals)
    served, recomputed = result.by_id(), cold.by_id()
    largest = max((abs(x) for rid in ids for x in recomputed[rid].logprobs or []), default=1.0)
    threshold = threshold_for(tolerance, largest)
    verdicts = []
    for rid in ids:
        hit, ref = served[rid], recomputed[rid]
        size, _, diffs = max_diff(hit.logprobs or [], ref.logprobs or [])
        first = next((i for i, d in enumerate(diffs) if d > threshold), None)
        verdicts.append(Verdict(
            rid, hit.num_cached_tokens or 0, hit.num_external_cached_tokens or 0, size, first,
            first is not None, list(hit.group_hits) if hit.group_hits is not None else None,
            store_keys_loaded(result, rid)))
    return RecomputeReport(tolerance, chunks, verdicts, threshold)


def report_lines(path: Any, report: RecomputeReport) -> list[str]:
    """What ``check --recompute`` prints after a target's golden lines."""
    n = len(report.verdicts)
    head = (f"recompute: {n} hit(s) replayed cold; tolerance {report.tolerance:.3g} "
            f"(the largest logprob difference of two cold computations at "
            f"max_num_batched_tokens {report.calibration_chunks[0]} and "
            f"{report.calibration_chunks[1]}), threshold {report.threshold:.3g} "
            f"({MARGIN:g}x, at least {FLOOR_ULPS} float32 ulps)")
    if not n:
        return [f"recompute: no request of {path} had a hit"]
    lines = [head]
    for v in report.verdicts:
        where = (f"{v.num_external_cached_tokens} of them from the store"
                 if v.num_external_cached_tokens else "local")
        if not v.wrong:
            lines.append(f"  {v.id}: hit {v.num_cached_tokens} ({where}) matches its "
                         f"recompute (largest difference {v.divergence:.3g})")
            continue
        groups = "" if v.group_hits is None else f"; each group alone: {v.group_hits}"
        shown = [f"group {k['group']} @ {k['boundary']}" for k in v.store_keys[:8]]
        more = len(v.store_keys) - len(shown)
        keys = "" if not v.store_keys else (
            f"; store keys loaded: {', '.join(shown)}" + (f" and {more} more" if more else ""))
        lines.append(f"  WRONG HIT {v.id}: hit {v.num_cached_tokens} ({where}) gives logprobs "
                     f"{v.divergence:.3g} away from its recompute ({v.divergence / report.threshold:.0f}x "
                     f"the threshold), first at output token {v.first_position}{groups}{keys}")
    return lines
