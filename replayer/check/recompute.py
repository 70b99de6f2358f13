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

Each hit is held to its **hit-shaped reference** (:mod:`.reference`): the hit
replay and every recompute run at one thread (:mod:`.chunk_cuts`), and the
reference chunks each hit's prompt as the hit's own computation was chunked
(the cached prefix as its writers chunked it, a chunk boundary where the hit
resumes, the hit's own chunks after it). Where it reproduced every chunk the
contract is **bit-exact**: any difference is a wrong hit. Where it could not
(a writer's chunk ran past the hit's resume point), the threshold is the
residue measured on right hits for the model's compute dtype
(:data:`.reference.RESIDUE_UNITS`, in units in the last place of that dtype).
Each verdict says which contract it used. Beside it, the **looser reference**:
the cold run at the trace's own chunking, held to :data:`MARGIN` times the
largest difference of the two cold chunkings over the positions the verdicts
compare (both compute prompt rows from each hit on only), never below :data:`FLOOR_UNITS`
units of the compute dtype. A hit past its contract is a **wrong hit**, named
with what served it (its hit, local or from the store, each group's own reach,
the store keys loaded for it), the first position that diverged and by how
much.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from replayer.check.divergence import (
    MARGIN,
    Crossing,
    DivergenceError,
    compare,
)
from replayer.check.reference import (
    RESIDUE_MEASURED,
    RESIDUE_UNITS,
    References,
    ScheduleLog,
    references,
    unit,
)
from replayer.replay.loop import ReplayResult
from traces import Trace

# How many most likely tokens are compared at each position (--recompute-topk).
TOPK = 20
# The looser reference's threshold is never below this many units in the last place
# of the compute dtype at the largest logprob (two cold runs may agree bit for bit).
FLOOR_UNITS = 1


@dataclass
class Verdict:
    """One hit request: its distributions beside its recompute's."""

    id: str
    num_cached_tokens: int
    num_external_cached_tokens: int
    divergence: float                  # the largest difference at any compared position
    first: Crossing | None             # the first position past the threshold, and how
    prompt_positions: int              # prompt positions compared (from the hit on)
    output_tokens: int                 # output tokens compared
    group_hits: list[int] | None = None
    store_keys: list[dict[str, Any]] = field(default_factory=list)
    contract: str = "bit-exact"        # what it was held to (:func:`contract`)
    threshold: float = 0.0             # that contract's threshold
    looser: float = 0.0                # largest difference from the looser reference
    looser_wrong: bool = False         # past the looser reference's threshold

    @property
    def wrong(self) -> bool:
        return self.first is not None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "num_cached_tokens": self.num_cached_tokens,
                "num_external_cached_tokens": self.num_external_cached_tokens,
                "divergence": self.divergence,
                "first_divergence": None if self.first is None else self.first.as_dict(),
                "prompt_positions": self.prompt_positions, "output_tokens": self.output_tokens,
                "verdict": "wrong hit" if self.wrong else "matches recompute",
                "contract": self.contract, "threshold": self.threshold,
                "looser": {"divergence": self.looser,
                           "verdict": "differs" if self.looser_wrong else "matches"},
                **({"group_hits": self.group_hits} if self.group_hits is not None else {}),
                **({"store_keys": self.store_keys} if self.store_keys else {})}


@dataclass
class RecomputeReport:
    tolerance: float                   # the two cold chunkings' largest difference (compared)
    looser_chunk: int                  # the looser reference's max_num_batched_tokens
    verdicts: list[Verdict]
    threshold: float = 0.0             # the looser reference's
    topk: int = TOPK
    dtype: str = "float32"             # the model's compute dtype
    unit: float = 0.0                  # one unit of it at the largest logprob

    @property
    def wrong(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.wrong]

    def as_dict(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "threshold": self.threshold, "topk": self.topk,
                "dtype": self.dtype, "unit": self.unit, "looser_max_num_batched_tokens": self.looser_chunk,
                "hits": [v.as_dict() for v in self.verdicts]}


def hit_requests(result: ReplayResult) -> list[str]:
    """Requests that resumed from a cached prefix (and were not aborted), in arrival order."""
    return [r.id for r in result.requests if (r.num_cached_tokens or 0) > 0 and not r.aborted]


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


def recomputed(ids: list[str], cold: ReplayResult) -> dict[str, Any]:
    """``cold``'s outcomes by id, every hit of ``ids`` among them (else the check
    fails closed: a hit with no recompute is never a pass)."""
    out = cold.by_id()
    missing = [rid for rid in ids if rid not in out]
    if missing:
        raise DivergenceError(f"request {missing[0]!r} had a hit and is missing from its "
                              f"recompute ({len(missing)} of {len(ids)} hit request(s) missing)")
    return out


def asking_distributions(trace: Trace, topk: int = TOPK) -> Trace:
    """``trace`` with the model worker asked for the top-``topk`` logprobs at every
    position (what :func:`recompute_check` compares)."""
    return replace(trace, logprob_topk=topk)


def hit_replay(trace: Trace, replay: Callable[..., ReplayResult], topk: int = TOPK
               ) -> tuple[ReplayResult, ScheduleLog]:
    """The replay whose hits :func:`recompute_check` checks: asked for its
    distributions (the prompt rows of its hits only), at one thread, its chunks
    logged (:mod:`.chunk_cuts`)."""
    log = ScheduleLog()
    hook, log.hit_path = log.hook(hits_only=True)
    try:
        return replay(asking_distributions(trace, topk), recorder=hook), log
    except BaseException:
        log.close()
        raise


def contract(refs: References, rid: str, largest: float) -> tuple[str, float]:
    """What ``rid`` is held to, said, and its threshold: bit for bit where its
    reference reproduced every chunk, else the residue measured for the dtype."""
    shape = refs.shapes[rid]
    if shape.why is None:
        return "bit-exact", 0.0
    n = RESIDUE_UNITS[refs.dtype]
    return (f"tolerance {n} units of {refs.dtype}, residue {RESIDUE_MEASURED} "
            f"({shape.why})", n * unit(largest, refs.dtype))


def recompute_check(trace: Trace, result: ReplayResult, replay: Callable[..., ReplayResult],
                    log: ScheduleLog, topk: int = TOPK,
                    side: Callable[..., ReplayResult] | None = None) -> RecomputeReport:
    """Every hit of ``result`` (:func:`hit_replay`'s, whose schedule ``log`` holds)
    held to its hit-shaped reference, and beside it to the looser one; ``replay``
    replays a trace on the same engine and worker, ``side`` too, at the same time
    as ``replay`` (the looser reference runs there, side by side). Fails closed
    (:class:`DivergenceError`): a hit the recompute lacks, or any comparison that
    cannot be made."""
    try:
        ids = hit_requests(result)
        if not ids:
            return RecomputeReport(0.0, 0, [], topk=topk)
        refs = references(trace, result, ids,
                          lambda t, **kw: replay(asking_distributions(t, topk), **kw),
                          log, log.hit_path,
                          None if side is None else
                          lambda t, **kw: side(asking_distributions(t, topk), **kw))
    finally:
        log.close()
    served, shaped, looser = result.by_id(), recomputed(ids, refs.shaped), recomputed(ids, refs.looser)
    largest = max((abs(x) for rid in ids for x in shaped[rid].logprobs or []), default=1.0)
    loose = MARGIN * max(refs.tolerance, FLOOR_UNITS * unit(largest, refs.dtype))
    verdicts = []
    for rid in ids:
        hit = served[rid]
        said, threshold = contract(refs, rid, largest)
        d = compare(hit, shaped[rid], threshold)
        far = compare(hit, looser[rid], loose).largest
        verdicts.append(Verdict(
            rid, hit.num_cached_tokens or 0, hit.num_external_cached_tokens or 0, d.largest,
            d.first, d.prompt_positions, d.output_tokens,
            list(hit.group_hits) if hit.group_hits is not None else None,
            store_keys_loaded(result, rid), said, threshold, far, far > loose))
    return RecomputeReport(refs.tolerance, refs.chunk, verdicts, loose, topk, refs.dtype,
                           unit(largest, refs.dtype))


def report_lines(path: Any, report: RecomputeReport) -> list[str]:
    """What ``check --recompute`` prints after a target's golden lines."""
    n = len(report.verdicts)
    head = (f"recompute: {n} hit(s) replayed cold at one thread, each held to its "
            f"hit-shaped reference (its chunks as the hit's computation had them); beside "
            f"it the cold run at max_num_batched_tokens {report.looser_chunk}: tolerance "
            f"{report.tolerance:.3g} (the two cold chunkings' largest difference), threshold "
            f"{report.threshold:.3g} ({MARGIN:g}x, at least {MARGIN * FLOOR_UNITS:g} units "
            f"of {report.dtype})")
    if not n:
        return [f"recompute: no request of {path} had a hit"]
    lines = [head]
    for v in report.verdicts:
        where = (f"{v.num_external_cached_tokens} of them from the store"
                 if v.num_external_cached_tokens else "local")
        compared = (f"{v.prompt_positions} prompt position(s) after the hit and "
                    f"{v.output_tokens} output token(s), {_topk(report.topk)}")
        held = (f"{v.contract}; looser reference: "
                f"{'differs' if v.looser_wrong else 'matches'}, {v.looser:.3g}")
        if not v.wrong:
            lines.append(f"  {v.id}: hit {v.num_cached_tokens} ({where}) matches its "
                         f"recompute (largest difference {v.divergence:.3g} over {compared}; "
                         f"{held})")
            continue
        groups = "" if v.group_hits is None else f"; each group alone: {v.group_hits}"
        shown = [f"group {k['group']} @ {k['boundary']}" for k in v.store_keys[:8]]
        more = len(v.store_keys) - len(shown)
        keys = "" if not v.store_keys else (
            f"; store keys loaded: {', '.join(shown)}" + (f" and {more} more" if more else ""))
        past = ("any difference" if not v.threshold
                else f"{v.divergence / v.threshold:.0f}x the threshold {v.threshold:.3g}")
        lines.append(f"  WRONG HIT {v.id}: hit {v.num_cached_tokens} ({where}) gives logprobs "
                     f"{v.divergence:.3g} away from its recompute ({past}; {held}), first at "
                     f"{v.first.said(report.topk)}{groups}{keys}")
    return lines


def _topk(k: int) -> str:
    return "the whole vocabulary" if k < 0 else f"top-{k}"
