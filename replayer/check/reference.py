"""What a hit is held to: its request recomputed cold, shaped like the hit.

The reference side of ``check --recompute`` (:mod:`.recompute` runs it,
:mod:`.divergence` compares). The hit replay and every reference run at one
thread with vLLM's scheduler logging its chunks (:mod:`.chunk_cuts`, the seam).
For every hit, :func:`shape_of` reads from that log the chunks that computed
the cached prefix (each hash unit's writer: the first request that computed it
with the same tokens before the hit) and the hit's own chunks after its resume
point; the **hit-shaped reference** replays the hit requests cold (a cache salt
each, no connector, no events), one after another, each with its chunks ended
exactly there, so it computes the same tokens the same way without any cache.
Where every chunk is reproduced (the log of the reference says so) the hit must
equal it bit for bit. The **looser reference** is the cold run at the trace's
own chunking, batched as the hits were; its tolerance is the largest difference
between the two cold chunkings (looser vs hit-shaped) over the positions the
verdicts compare. Both compute prompt logprobs only there, from each hit on
(:mod:`.chunk_cuts`). Neither reference reads the other, so given a second
engine process they run side by side, one intra-op thread each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayer.check.chunk_cuts import install
from replayer.check.divergence import largest_difference, rows_from
from replayer.replay.loop import ReplayResult
from traces import Trace
from traces.model.engine_spec import EngineBlock
from traces.materialize import TokenSource

SALT = "prefix-replayer recompute"
# The connector's settings: a recompute reads no store.
STORE_KEYS = ("connector", "connector_config", "kv_load_failure_policy",
              "mooncake_global_segment_size")
# Right hits whose reference could not reproduce every chunk (a writer's chunk
# that ran past the hit's resume point; vLLM's Mamba alignment cutting a chunk
# the writer did not have) are held to this many units in the last place of the
# model's compute dtype at the largest output logprob. The residue measured on
# right hits (benchmarks/recompute_cost.py --residue, 2026-12-05: 29 hits
# over 9 fixtures the model worker runs, fp32 Llama and bf16 Qwen3-Next) was 0
# units in both. float32 keeps 4 units (one reordered fp32 summation in the
# attention kernel moved logprobs ~3e-7, a few units, in DESIGN.md's
# measurements); bfloat16 keeps none: one bf16 unit at a logprob is already
# ~0.06 nats, the size of a wrong hit.
RESIDUE_UNITS = {"float32": 4, "bfloat16": 0}
RESIDUE_MEASURED = "measured 0 on 29 right hits over 9 fixtures, 2026-12-05"


def compute_dtype(engine: EngineBlock) -> str:
    """The tiny model's dtype (replay.engines.worker.models.target_config: a hybrid
    is Qwen3-Next in bf16, everything else Llama in fp32)."""
    return "bfloat16" if engine.has_mamba else "float32"


def unit(x: float, dtype: str) -> float:
    """One unit in the last place of ``dtype`` at ``x``."""
    a = abs(x) or 1.0
    if dtype == "bfloat16":
        return 2.0 ** (math.floor(math.log2(a)) - 7)
    return float(np.spacing(np.float32(a)))


# -- the schedule log ------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    step: int
    order: int          # its place among the step's scheduled requests
    start: int
    n: int


class ScheduleLog:
    """Where each replay's scheduler logs its chunks (:mod:`.chunk_cuts`)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="replayer-recompute-"))
        self._n = 0

    def hook(self, cuts: dict[str, list[int]] | None = None, hits_only: bool = False,
             rows_from: dict[str, int] | None = None) -> tuple[Any, Path]:
        """A replay's ``recorder`` (one thread, log, cuts; prompt rows with
        ``hits_only`` for the requests that hit only, from their hit; with
        ``rows_from`` from each request's position given), and where its log goes."""
        self._n += 1
        path = self.dir / f"{self._n}.jsonl"
        return partial(install, str(path), cuts, hits_only, rows_from), path

    @staticmethod
    def read(path: Path) -> dict[str, list[Chunk]]:
        """Each request's chunks, in the order they were scheduled."""
        out: dict[str, list[Chunk]] = {}
        if not path.exists():
            return out
        for line in path.read_text(encoding="utf-8").splitlines():
            step, rows = json.loads(line)
            for order, (rid, start, n) in enumerate(rows):
                out.setdefault(rid, []).append(Chunk(step, order, start, n))
        return out

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the shape of a hit ---------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """Where a hit's reference must end its prefill chunks, and whether those are
    every chunk that computed what the hit read (``why``: why not)."""

    cuts: tuple[int, ...]
    prompt_len: int
    why: str | None = None


def _prefill(chunks: list[Chunk], prompt_len: int) -> list[Chunk] | None:
    """A request's chunks up to its prompt's end, None if they do not run on from
    one another (a preemption restarted it)."""
    out = []
    for c in chunks:
        if c.start >= prompt_len:
            break
        if out and c.start != out[-1].start + out[-1].n:
            return None
        out.append(c)
    return out


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def shape_of(hit: str, resume: int, tokens: dict[str, np.ndarray], prompt_len: dict[str, int],
             salts: dict[str, Any], log: dict[str, list[Chunk]], unit_tokens: int) -> Shape:
    """The chunks that computed ``hit``'s first ``resume`` tokens (each hash unit's
    writer: the first request, by step and place in it, that computed the whole
    unit with the same tokens before the hit was scheduled), then its own."""
    # A hit of the whole prompt: vLLM recomputes its last token (the first output
    # token's logits need it), so the computation resumes one token before the hit.
    resume = min(resume, prompt_len[hit] - 1)
    own = _prefill(log.get(hit, []), prompt_len[hit])
    if not own or own[0].start != resume:
        return Shape((), prompt_len[hit], "its own chunks do not start at its hit "
                                          "(preempted?)")
    first = (own[0].step, own[0].order)
    mine = tokens[hit][:resume]
    writers: list[tuple[list[Chunk], int]] = []    # (prefill chunks, shared tokens)
    for rid, chunks in log.items():
        if rid == hit or salts.get(rid) != salts.get(hit) or rid not in tokens:
            continue
        pre = _prefill(chunks, prompt_len[rid])        # its prompt's chunks (decodes: one
        shared = _lcp(tokens[rid], mine)                # position kept per accepted token)
        if pre and shared >= unit_tokens:
            writers.append((pre, shared))
    used: set[Chunk] = set()
    for u in range(-(-resume // unit_tokens)):         # the last unit may end at resume
        lo, hi = u * unit_tokens, min((u + 1) * unit_tokens, resume)
        best = None
        for pre, shared in writers:
            if shared < hi or pre[0].start > lo or pre[-1].start + pre[-1].n < hi:
                continue
            span = [c for c in pre if c.start < hi and c.start + c.n > lo]
            when = (span[-1].step, span[-1].order)
            if when < first and (best is None or when < best[0]):
                best = (when, span)
        if best is None:
            return Shape((), prompt_len[hit],
                         f"no request before it computed tokens {lo}-{hi} of its hit")
        used.update(best[1])
    cuts = sorted({c.start for c in used} | {resume} | {c.start for c in own}) + [prompt_len[hit]]
    for c in sorted(used, key=lambda c: c.start):
        end = cuts[cuts.index(c.start) + 1]
        if c.start + c.n != end:
            return Shape(tuple(cuts[1:-1]), prompt_len[hit],
                         f"a chunk that computed its prefix ran {c.start}-{c.start + c.n}, "
                         f"past {end}")
    return Shape(tuple(cuts[1:-1]), prompt_len[hit])


def shapes(trace: Trace, result: ReplayResult, ids: list[str],
           log: dict[str, list[Chunk]]) -> dict[str, Shape]:
    """Every hit's :class:`Shape` from the hit replay's schedule log."""
    source = TokenSource(trace.header, trace.requests, trace.request_lists)
    rows = {rid: i for i, rid in enumerate(trace.requests["id"].to_pylist())}
    salts = dict(zip(trace.requests["id"].to_pylist(),
                     trace.requests["cache_salt"].to_pylist()
                     if "cache_salt" in trace.requests.column_names
                     else [None] * trace.requests.num_rows))
    tokens, prompt_len = {}, {}
    for r in result.requests:
        i = rows[r.id]
        prompt = source.prompt(i)
        out = source.output(i, int(trace.requests["output_len"][i].as_py()), 0)
        tokens[r.id] = np.concatenate([prompt, out])
        prompt_len[r.id] = len(prompt)
    engine = trace.engine
    unit_tokens = engine.prefix_match_unit or max(g.block_size for g in engine.kv_groups)
    served = result.by_id()
    return {rid: shape_of(rid, served[rid].num_cached_tokens or 0, tokens, prompt_len, salts,
                          log, unit_tokens) for rid in ids}


# -- the cold runs ------------------------------------------------------------------

def cold_trace(trace: Trace, ids: list[str], max_num_batched_tokens: int | None = None,
               arrivals: dict[str, int] | None = None) -> Trace:
    """``ids`` replayed cold, each under a cache salt of its own (no cached block, no
    store key can serve it), no connector, no events, the same engine
    (``max_model_len`` and ``num_gpu_blocks`` pinned to the original's, so the model
    and the cache are the same). ``arrivals``: each request enters at the step it
    entered the original replay (batched as it was); without, one after another.
    ``max_num_batched_tokens`` changes only the prefill chunking. A recorded steps
    table is kept for these requests (drafts accepted as recorded)."""
    sized = trace.sized_engine()
    settings = {k: v for k, v in sized.to_header().items() if k not in STORE_KEYS}
    settings.update(max_model_len=sized.max_model_len, num_gpu_blocks=sized.num_gpu_blocks)
    if max_num_batched_tokens is not None:
        settings["max_num_batched_tokens"] = max_num_batched_tokens
    engine = EngineBlock.from_dict("engine", settings)
    keep = pc.is_in(trace.requests["id"], value_set=pa.array(ids, pa.string()))
    requests = trace.requests.filter(keep)
    order = {rid: i for i, rid in enumerate(ids)}
    requests = requests.take(sorted(range(requests.num_rows),
                                    key=lambda i: order[requests["id"][i].as_py()]))
    n = requests.num_rows
    rids = [requests["id"][i].as_py() for i in range(n)]
    if arrivals is None:
        steps, after = [0] + [None] * (n - 1), [None] + rids[:-1]
    else:
        steps, after = [arrivals[r] for r in rids], [None] * n
    columns = {"arrival_step": pa.array(steps, pa.int64()),
               "after": pa.array(after, pa.string()),
               "cache_salt": pa.array([f"{SALT}:{r}" for r in rids], pa.string())}
    for name, values in columns.items():
        if name in requests.column_names:
            requests = requests.set_column(requests.column_names.index(name), name, values)
        else:
            requests = requests.append_column(name, values)
    for name in ("arrival_ms", "arrival_order"):
        if name in requests.column_names:
            requests = requests.drop_columns([name])
    recorded = trace.steps
    if recorded is not None:
        recorded = recorded.filter(pc.is_in(recorded["id"], value_set=pa.array(ids, pa.string())))
    header = {**trace.header, "engine": engine}
    return dataclasses.replace(
        trace, header=header, requests=requests, events=None, outcomes=None, steps=recorded,
        store_ops=None, kv_events=None, goldens={}, store_goldens={}, event_goldens={},
        kv_events_wanted=False, expect_recompute=False, request_lists=None, skipped_parts=[],
        notes=[])


@dataclass
class References:
    """The two references of the hits and how each hit's shape was kept."""

    shaped: ReplayResult              # the hit-shaped reference
    looser: ReplayResult              # the cold run at the trace's chunking, batched as the hits
    shapes: dict[str, Shape]          # ``why`` also says a reference that missed its cuts
    tolerance: float                  # the two cold chunkings' largest difference (compared)
    chunk: int                        # the looser run's max_num_batched_tokens
    dtype: str


def references(trace: Trace, result: ReplayResult, ids: list[str],
               replay: Callable[..., ReplayResult], log: ScheduleLog, hit_log: Path,
               side: Callable[..., ReplayResult] | None = None) -> References:
    """Both references of ``ids`` (hits of ``result``, whose schedule is ``hit_log``).
    They do not depend on each other: given ``side`` (a replay that may run while
    ``replay`` does: another engine process), the looser one runs there at the
    same time, each at one thread in its own process; else one after the other.
    Either way the same two results. Each computes prompt rows from each hit on
    only: the positions a verdict compares, over which the tolerance is taken."""
    wanted = shapes(trace, result, ids, log.read(hit_log))
    cuts = {rid: list(s.cuts) for rid, s in wanted.items() if s.cuts}
    served = result.by_id()
    hits = {rid: served[rid].num_cached_tokens or 0 for rid in ids}
    hook, path = log.hook(cuts, rows_from=hits)
    arrivals = {r.id: r.arrival_step for r in result.requests}
    chunk = trace.sized_engine().max_num_batched_tokens or 2048
    loose_hook, _ = log.hook(rows_from=hits)
    loose_trace = cold_trace(trace, ids, chunk, arrivals)
    if side is None:
        shaped = replay(cold_trace(trace, ids), recorder=hook)
        looser = replay(loose_trace, recorder=loose_hook)
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:   # waits for it, even on an error
            later = pool.submit(side, loose_trace, recorder=loose_hook)
            shaped = replay(cold_trace(trace, ids), recorder=hook)
            looser = later.result()
    done = log.read(path)
    for rid, s in wanted.items():
        got = tuple(c.start for c in _prefill(done.get(rid, []), s.prompt_len) or [])[1:]
        if s.why is None and got != s.cuts:
            wanted[rid] = dataclasses.replace(
                s, why=f"its reference was chunked at {list(got)[:8]}, not at {list(s.cuts)[:8]}")
    shaped, looser = _from_hits(shaped, hits), _from_hits(looser, hits)
    a, b = shaped.by_id(), looser.by_id()
    # Every position and measure a verdict compares (fails closed like it).
    tolerance = max((largest_difference(a[rid], b[rid], hits[rid]) for rid in ids), default=0.0)
    return References(shaped, looser, wanted, tolerance, chunk, compute_dtype(trace.engine))


def _from_hits(cold: ReplayResult, hits: dict[str, int]) -> ReplayResult:
    """``cold`` with each hit request's prompt rows from its hit on: the rows
    computed (those before it were left unwritten)."""
    return dataclasses.replace(cold, requests=[
        rows_from(r, hits[r.id]) if r.id in hits else r for r in cold.requests])
