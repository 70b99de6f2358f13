"""Where the hits went: reachable vs actual per request, the loss split by cause.

``reachable`` comes from the trace alone (:mod:`traces.reachable`); ``actual``
from the replay. The gap is split into causes by counterfactual replays, each
through the normal replay entry point and each changing one thing on top of
the previous one, so the causes telescope and add up exactly:

0. store, on a CPU offload trace (``connector: offloading``): a CPU tier that
   never evicts (what the tier evicted before a request looked it up; a
   GPU eviction the tier gives back loses nothing);
1. capacity: the same trace with a KV cache large enough that nothing is
   ever evicted;
2. store (a trace with a connector) or reset: without its
   ``reset_prefix_cache`` events and targeted ``evict`` / ``store_remove`` /
   ``store_fault`` events (what the store should have given back);
3. eagle_drop: without speculative decoding (the EAGLE/MTP drop and its
   lookahead block hashes);
4. sparse_retention: ``prefix_cache_retention_interval: null`` (vLLM's dense
   checkpoints for Mamba and sliding-window groups);

then what the last replay still misses of the reachable prefix floored to
vLLM's ``cache_hit_alignment_tokens`` is split by vLLM's own per-group
lookup (``find_longest_cache_hit_per_group``) on that replay: a Mamba group
that stopped short is sparse retention (state not kept there), a
sliding-window group is the window; a hit of the whole prompt a connector
loaded is ``whole_prompt`` (negative: above the reachable prefix, which
stops below the last prompt token); what no cause explains is
``unexplained``, reported, never folded into another cause. ``alignment``
is the reachable prefix minus that floor. ``preemption`` is measured as
what vLLM itself reports: where the adapter says its release keeps a
request's first scheduled prefill in ``prefill_stats`` ("not post-preemption
repeat prefills"; ``EngineAdapter.hits_are_first_prefill``), a preemption
never changes a reported hit; what a preempted request's freed blocks cost
others is eviction, counted as capacity.

Beside the causes (:func:`_beside_the_causes`), what loses no token or needs
more than a count: a prefix shared below one unit (``shared_tokens``, token
granular, from :func:`traces.reachable.shared_tokens`), the store keys a
``store`` loss missed and the attention a store load fetched again while it
was resident (:mod:`replayer.analysis.explain_store`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from math import ceil
from typing import Any, Callable

import polars as pl

from replayer.analysis.explain_store import Refetch, StoreMiss, refetched, store_misses
from replayer.replay.loop import ReplayResult
from traces import Trace
from traces.model.engine_spec import RETAIN_DENSE
from traces.model.errors import TraceError
from traces.reachable import Clock, prefix_match_unit, reachable_hits, shared_tokens
from traces.scenarios.what_if import with_sets

CAUSES = ("capacity", "store", "reset", "eagle_drop", "sparse_retention", "sliding_window",
          "alignment", "whole_prompt", "preemption", "unexplained")

#: Why a connector's hit can pass the reachable prefix: reachable stops below the
#: last prompt token, as vLLM's own lookup does (``get_computed_blocks``: at most
#: ``num_tokens - 1``), but a connector may load the whole prompt, and vLLM
#: reports every token of it cached while it computes the last one again
#: (``Scheduler._update_waiting_for_remote_kv``) to sample the next.
WHOLE_PROMPT = ("a connector loaded the whole prompt: vLLM reports every prompt token cached "
                "and computes the last one again (Scheduler._update_waiting_for_remote_kv), "
                "where reachable stops below the last prompt token as vLLM's own lookup does "
                "(negative: tokens hit above the reachable prefix)")

Replayer = Callable[[Trace], ReplayResult]

#: Why dense checkpoints cannot give a Mamba group state it never had: vLLM's
#: align mode (``CacheConfig.mamba_cache_mode``) caches "the mamba state of the
#: last token of each scheduler step and when the token is at position i *
#: block_size", plus a shared-prefix junction once a lookup has found it; the
#: retention interval only decides which of those are kept.
MAMBA_WRITES = ("; a Mamba group has state only where a scheduler step's prefill chunk ended "
                "on a block boundary (or at a shared-prefix junction a lookup found first): "
                "dense retention keeps every state written, it writes none")

#: Events that empty the GPU cache or the store, or make the store fail: one
#: counterfactual removes them all.
EMPTYING_EVENTS = ("reset_prefix_cache", "evict", "store_remove", "store_fault")


@dataclass(frozen=True)
class Counterfactual:
    """One change on top of the previous replay, and the cause it measures."""

    cause: str
    change: str
    evidence: str
    apply: Callable[[Trace], Trace]


def _with_engine(trace: Trace, sets: list[str]) -> Trace:
    """The trace under its engine block changed as ``--set`` would change it."""
    return with_sets(trace, sets)


def unbounded_blocks(trace: Trace) -> int:
    """KV blocks for every token of every request at once, in every group."""
    engine = trace.sized_engine()
    sizes = [g.block_size for g in engine.kv_groups]
    smallest = min(sizes)
    n_spec = engine.num_speculative_tokens
    rq = trace.requests
    total = sum(ceil((p + o + n_spec + 1) / smallest) + 1
                for p, o in zip(rq["num_prompt_tokens"].to_pylist(), rq["output_len"].to_pylist()))
    return max(int(engine.num_gpu_blocks), total * len(sizes) + 64)


def counterfactuals(trace: Trace) -> list[Counterfactual]:
    """The chain of replays this trace needs (steps that change nothing are left out)."""
    engine = trace.engine
    steps = []
    blocks = unbounded_blocks(trace)
    if engine.connector == "offloading":
        # At least one chunk per block of every request in every group: no key is
        # ever evicted (the replay allocates no CPU memory; vLLM only divides it).
        tier = int(engine.connector_config["cpu_bytes_to_use"]) * blocks
        steps.append(Counterfactual(
            "store", f"cpu_bytes_to_use={tier} (a CPU tier that never evicts)",
            "replay with a CPU tier that never evicts minus the baseline: chunks the tier "
            "evicted to make room before a request looked them up",
            lambda t: _with_engine(t, [f"engine.connector_config.cpu_bytes_to_use={tier}"])))
    if blocks > trace.sized_engine().num_gpu_blocks:
        steps.append(Counterfactual(
            "capacity", f"num_gpu_blocks={blocks} (room for every request at once)",
            "replay with a KV cache that never evicts minus the "
            + ("previous" if steps else "baseline replay"),
            lambda t: _with_engine(t, [f"engine.num_gpu_blocks={blocks}"])))
    events = trace.events
    actions = events["action"].to_pylist() if events is not None else []
    emptying = [a for a in EMPTYING_EVENTS if a in actions]
    if emptying:
        # Targeted evict / store_remove events empty the cache (or store) as a
        # reset does: they leave with the resets, before any rule that changes
        # which keys are written (a store_remove names keys the baseline wrote).
        keep = [a not in EMPTYING_EVENTS for a in actions]
        connector = bool(engine.connector)
        cause = "store" if connector else "reset"
        named = ", ".join(emptying)
        evidence = (f"replay without the {named} events minus the previous: what the "
                    "store did not give back after a reset (a lookup missed or a key was not "
                    "written)" if connector else
                    f"replay without the {named} events minus the previous")

        def drop_resets(t: Trace, keep=keep) -> Trace:
            ev = t.events.filter(keep) if any(keep) else None
            return replace(t, events=ev)
        steps.append(Counterfactual(cause, f"{named} events removed", evidence,
                                    drop_resets))
    if engine.speculative is not None:
        steps.append(Counterfactual(
            "eagle_drop", "speculative decoding removed",
            "replay without speculative decoding minus the previous (the EAGLE/MTP drop and "
            "its lookahead block hashes)",
            lambda t: _with_engine(t, ["engine.speculative=null"])))
    kinds = {g.kind for g in engine.kv_groups}
    # Omitted, the interval is vLLM's default (0 in 0.33: only the latest boundary).
    if (kinds & {"mamba", "sliding_window"}
            and engine.prefix_cache_retention_interval != RETAIN_DENSE):
        steps.append(Counterfactual(
            "sparse_retention", "prefix_cache_retention_interval: null (dense checkpoints)",
            "replay with dense Mamba/SWA checkpoints minus the previous, plus what vLLM's "
            "per-group lookup (find_longest_cache_hit_per_group) shows a Mamba group could not "
            "serve on the last replay",
            lambda t: _with_engine(t, ["engine.prefix_cache_retention_interval=null"])))
    return steps


@dataclass
class Explanation:
    """Per-request accounting and how each cause was measured."""

    engine: Any                         # traces.model.engine_spec.EngineBlock
    unit: int
    hit_alignment: int
    table: pl.DataFrame                 # one row per request, arrival order
    evidence: dict[str, str]
    replays: list[dict[str, Any]]       # baseline then each counterfactual: change, summary
    baseline: ReplayResult
    timings: dict[str, float] = field(default_factory=dict)
    # Requests whose hit stopped, on the last counterfactual (dense checkpoints
    # included), where a Mamba group had no state: id -> (tokens the Mamba groups
    # could serve, tokens the hit needed them to). Part of their sparse_retention.
    mamba_short: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Requests whose reachable hit is 0 although they share a prefix with an
    # earlier prompt shorter than one unit: id -> (shared tokens, from whom).
    below_unit: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Requests that lost tokens to the store: the keys missing, by group and
    # boundary, on the replay the store counterfactual is measured against.
    store_misses: dict[str, list[StoreMiss]] = field(default_factory=dict)
    # Attention tokens fetched from the store while resident locally (baseline).
    refetched: dict[str, Refetch] = field(default_factory=dict)
    block_size: int = 0

    def totals(self) -> dict[str, int]:
        return {c: int(self.table[f"lost_{c}"].sum()) for c in CAUSES}

    def summary(self) -> dict[str, Any]:
        prompt = int(self.table["num_prompt_tokens"].sum())
        reach = int(self.table["reachable"].sum())
        actual = int(self.table["actual"].sum())
        return {"requests": self.table.height, "prompt_tokens": prompt, "reachable": reach,
                "actual": actual,
                "reachable_rate": round(reach / prompt, 6) if prompt else 0.0,
                "hit_rate": round(actual / prompt, 6) if prompt else 0.0,
                "lost": self.totals(), "steps": self.baseline.steps}

    def as_dict(self) -> dict[str, Any]:
        reqs = []
        for r in self.table.iter_rows(named=True):
            reqs.append({"id": r["id"], "reachable": r["reachable"], "actual": r["actual"],
                         "reachable_from": r["reachable_from"],
                         "lost": {c: r[f"lost_{c}"] for c in CAUSES}})
        kinds = {g["group"]: g["kind"] for g in (self.baseline.kv_groups or [])}
        return {"engine": self.baseline.engine.as_dict(), "prefix_match_unit": self.unit,
                "hit_alignment": self.hit_alignment, "evidence": self.evidence,
                "replays": self.replays, "requests": reqs, "summary": self.summary(),
                "below_unit": [{"id": rid, "shared_tokens": n, "shared_from": src}
                               for rid, (n, src) in self.below_unit.items()],
                "store_misses": {rid: [{"op": m.op, "group": m.group, "boundary": m.boundary,
                                        "result": m.result, "said": m.said(kinds)}
                                       for m in ms] for rid, ms in self.store_misses.items()},
                "refetched": {rid: r.as_dict() for rid, r in self.refetched.items()}}

    def dumps(self) -> str:
        return json.dumps(self.as_dict(), indent=2) + "\n"


def _clock(result: ReplayResult) -> Clock:
    """Who could see whose prefix in this replay: the order of vLLM's lookups.

    Falls back to arrival order and the replay clock for adapters that do not
    report their lookups."""
    rows = result.requests
    if result.lookups is None:
        return Clock(order=[r.id for r in rows],
                     step={r.id: r.arrival_step for r in rows},
                     finish_step={r.id: (None if r.aborted else r.finish_step) for r in rows})
    never = (1 << 62, 0)                      # aborted before any lookup: last
    order = sorted((result.lookups.get(r.id, never), k, r.id) for k, r in enumerate(rows))
    done = result.finished_engine_step
    return Clock(order=[rid for _, _, rid in order],
                 step={rid: at[0] for at, _, rid in order},
                 finish_step={r.id: (None if r.aborted else done.get(r.id)) for r in rows})


def _cached(result: ReplayResult) -> dict[str, int]:
    return {r.id: int(r.num_cached_tokens or 0) for r in result.requests}


def preemption_evidence(result: ReplayResult) -> str:
    """Why preemption is 0, from what the engine's adapter says of its hits."""
    if result.hits_are_first_prefill:
        return ("the engine reports a request's first scheduled prefill (vLLM's "
                "prefill_stats skips post-preemption repeat prefills), so a preemption never "
                "changes a reported hit; blocks it freed and others lost count as capacity")
    return ("this engine's adapter does not say whether a preemption's repeat prefill can "
            "change a reported hit, so preemption is not measured (0); blocks it freed and "
            "others lost count as capacity")


def _limiting_kind(request: Any, kv_groups: list[dict[str, Any]] | None,
                   actual: int, target: int) -> str:
    """Which cause vLLM's per-group lookup names for a hit short of ``target``."""
    hits = request.group_hits
    if not hits or not kv_groups:
        return "unexplained"
    low = min(hits)
    kinds = {g["kind"] for g, h in zip(kv_groups, hits) if h == low}
    if low >= target:
        return "unexplained"
    if "mamba" in kinds:
        return "sparse_retention"
    if "sliding_window" in kinds:
        return "sliding_window"
    return "unexplained"


def refuse_unexplainable(trace: Trace) -> None:
    """A geometry whose hits are not prefix reuse has no reachable hits to explain."""
    if any(g.kind == "chunked_local" for g in trace.engine.kv_groups):
        raise TraceError(trace.path, "explain cannot account for a chunked_local group: vLLM "
                         "counts the tokens before the current attention chunk as computed "
                         "without any cache, so reachable hits are not defined for it "
                         "(run and check replay it)")
    if trace.engine.prefill_instance is not None:
        raise TraceError(trace.path, "explain cannot account for a prefill/decode pair "
                         "(engine.prefill_instance): the decode instance's hits come from "
                         "its own request's prefill on the other instance, which reachable "
                         "hits, reuse between requests, do not model (run and check replay it)")


def explain(trace: Trace, run: Replayer, *,
            progress: Callable[[str], None] | None = None,
            run_many: Callable[[list[Trace]], list[ReplayResult]] | None = None) -> Explanation:
    """Replay ``trace`` and its counterfactuals with ``run`` (a runner from
    :func:`replayer.replay.execution.clients.engine_runner`: the one way an engine opens) and
    account for every lost token. ``run_many``: replays a list of traces at
    once (the warm server's forks); the counterfactual traces never depend on
    a replay's outcome, so every replay can start together and the result is
    the same as one after the other."""
    refuse_unexplainable(trace)
    chain = _Chain(trace, counterfactuals(trace))
    chain.run(run, progress or (lambda _msg: None), run_many)
    base = chain.results[0]
    reach = reachable_hits(trace, _clock(base))
    unit = prefix_match_unit(trace.engine)
    align = int(base.hit_alignment or unit)
    ids = reach["id"].to_list()
    lost, evidence = chain.split(ids)
    mamba_short = _below_the_floor(chain.results[-1], reach, align, unit, lost)
    evidence.update(_evidence_beside_the_chain(trace, base, align, evidence, lost,
                                               mamba_short))
    actual = _cached(base)
    why = base.by_id()
    shared = shared_tokens(trace, _clock(base))
    if shared is not None:
        reach = reach.join(shared, on="id", how="left")
    else:
        reach = reach.with_columns(pl.col("reachable").alias("shared_tokens"),
                                   pl.col("reachable_from").alias("shared_from"))
    frame = reach.with_columns(
        pl.Series("actual", [actual[i] for i in ids], dtype=pl.Int64),
        pl.Series("arrival_step", [why[i].arrival_step for i in ids], dtype=pl.Int64),
        *[pl.Series(f"lost_{c}", [lost[c][i] for i in ids], dtype=pl.Int64) for c in CAUSES])
    frame = frame.select("id", "arrival_step", "num_prompt_tokens", "reachable", "actual",
                         *[f"lost_{c}" for c in CAUSES], "reachable_from", "shared_tokens")
    return Explanation(engine=trace.engine, unit=unit, hit_alignment=align, table=frame,
                       evidence={c: evidence[c] for c in CAUSES}, replays=chain.replays,
                       baseline=base, mamba_short=mamba_short,
                       **_beside_the_causes(trace, frame, reach, base, chain.before_store))


@dataclass
class _Chain:
    """The baseline and its counterfactuals, each on top of the previous one."""

    trace: Trace
    steps: list[Counterfactual]
    results: list[ReplayResult] = field(default_factory=list)
    replays: list[dict[str, Any]] = field(default_factory=list)
    # The replay the first store step is measured against: its store misses are said.
    before_store: ReplayResult | None = None

    def run(self, run: Replayer, say: Callable[[str], None],
            run_many: Callable[[list[Trace]], list[ReplayResult]] | None) -> None:
        """Every replay of the chain, at once where ``run_many`` is given."""
        if run_many is not None:
            traces = [self.trace]
            for step in self.steps:
                traces.append(step.apply(traces[-1]))
            say(f"{len(traces)} replays at once")
            self.results = list(run_many(traces))
        else:
            say("baseline replay")
            self.results = [run(self.trace)]
            current = self.trace
            for step in self.steps:
                say(f"counterfactual: {step.change}")
                current = step.apply(current)
                self.results.append(run(current))
        self.replays = [{"change": "baseline (the trace as given)",
                         "summary": self.results[0].summary()}]
        for step, result in zip(self.steps, self.results[1:]):
            self.replays.append({"change": step.change, "cause": step.cause,
                                 "summary": result.summary()})

    def split(self, ids: list[str]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        """Tokens each step gained over the previous replay, by cause and request,
        and how each cause was measured (a cause measured twice says both)."""
        lost: dict[str, dict[str, int]] = {c: dict.fromkeys(ids, 0) for c in CAUSES}
        evidence: dict[str, str] = {}
        prev = _cached(self.results[0])
        for step, before, result in zip(self.steps, self.results, self.results[1:]):
            if step.cause == "store" and self.before_store is None:
                self.before_store = before
            now = _cached(result)
            for rid in ids:
                lost[step.cause][rid] += now[rid] - prev[rid]
            prev = now
            evidence[step.cause] = "; then ".join(filter(None, (evidence.get(step.cause),
                                                                 step.evidence)))
        return lost, evidence


def _below_the_floor(last: ReplayResult, reach: pl.DataFrame, align: int, unit: int,
                     lost: dict[str, dict[str, int]]) -> dict[str, tuple[int, int]]:
    """What the last replay still misses of each reachable prefix: the part below
    the hit alignment is ``alignment``, the rest the cause vLLM's per-group lookup
    names (``unexplained`` where it names none); a hit above it is ``whole_prompt``
    where it is the whole prompt and reachable its cap (else ``unexplained``).
    Returns the requests a Mamba group stopped short: id -> (what the Mamba groups
    could serve, the floor)."""
    by_id = last.by_id()
    got = _cached(last)
    mamba_short: dict[str, tuple[int, int]] = {}
    for rid, r, n in zip(reach["id"].to_list(), reach["reachable"].to_list(),
                         reach["num_prompt_tokens"].to_list()):
        floor = (r // align) * align
        lost["alignment"][rid] = r - floor
        gap = floor - got[rid]
        if gap > 0:
            cause = _limiting_kind(by_id[rid], last.kv_groups, got[rid], floor)
        elif gap < 0:
            # reachable's cap: whole units below the last prompt token (traces.reachable).
            whole = got[rid] == n and r == (n - 1) // unit * unit
            cause = "whole_prompt" if whole else "unexplained"
        if gap:
            lost[cause][rid] += gap
            if cause == "sparse_retention":
                mamba_short[rid] = (min(by_id[rid].group_hits), floor)
    return mamba_short


def _evidence_beside_the_chain(trace: Trace, base: ReplayResult, align: int,
                               evidence: dict[str, str], lost: dict[str, dict[str, int]],
                               mamba_short: dict[str, tuple[int, int]]) -> dict[str, str]:
    """How each cause no counterfactual measured (or measured only in part) was found."""
    out: dict[str, str] = {}
    out["alignment"] = (f"the reachable prefix minus its floor to vLLM's "
                        f"cache_hit_alignment_tokens ({align})")
    kinds = {g.kind for g in trace.engine.kv_groups}
    no_state = sum(floor - low for low, floor in mamba_short.values())
    if "sparse_retention" in evidence:
        dense = sum(lost["sparse_retention"].values()) - no_state
        out["sparse_retention"] = (
            f"replay with dense Mamba/SWA checkpoints minus the previous ({dense}), plus "
            f"where vLLM's per-group lookup (find_longest_cache_hit_per_group) on that replay "
            f"shows a Mamba group had no state ({no_state}){MAMBA_WRITES if no_state else ''}")
    elif "mamba" in kinds:
        out["sparse_retention"] = (
            "what vLLM's per-group lookup (find_longest_cache_hit_per_group) on the last replay "
            f"shows a Mamba group could not serve{MAMBA_WRITES if no_state else ''}")
    else:
        out["sparse_retention"] = ("no Mamba or sliding-window group in this geometry: "
                                   "nothing to measure")
    out["sliding_window"] = (
        "what vLLM's per-group lookup on the last replay shows a sliding-window group could "
        "not serve" if "sliding_window" in kinds
        else "no sliding-window group in this geometry: nothing to measure")
    out["whole_prompt"] = (WHOLE_PROMPT if trace.engine.connector else
                           "no connector in this trace: a hit stops below the last prompt "
                           "token, as reachable does")
    out["preemption"] = preemption_evidence(base)
    out["unexplained"] = ("reachable minus actual minus every cause above; nonzero is a "
                          "finding")
    if "capacity" not in evidence:
        out["capacity"] = ("the KV cache already holds every request at once: nothing is "
                           "ever evicted")
    for c in ("store", "reset", "eagle_drop"):
        if c not in evidence:
            out[c] = "no such rule in this geometry or trace: nothing to measure"
    return out


def _beside_the_causes(trace: Trace, frame: pl.DataFrame, reach: pl.DataFrame,
                       base: ReplayResult, before_store: ReplayResult | None) -> dict[str, Any]:
    """What no lost token shows: a prefix shared below one unit, the store keys a
    store loss missed, and attention the store fetched again while resident."""
    below = reach.filter((pl.col("reachable") == 0) & (pl.col("shared_tokens") > 0))
    lost_store = frame.filter(pl.col("lost_store") != 0)["id"].to_list()
    engine = trace.sized_engine()
    return {"below_unit": dict(zip(below["id"].to_list(),
                                   zip(below["shared_tokens"].to_list(),
                                       below["shared_from"].to_list()))),
            "store_misses": (store_misses(before_store, lost_store)
                             if before_store is not None and lost_store else {}),
            "refetched": refetched(base, {i: g.block_size
                                          for i, g in enumerate(engine.kv_groups)}),
            "block_size": int(engine.block_size)}
