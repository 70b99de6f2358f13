"""Reachable prefix hits: what an infinite cache with no dropping rule could serve.

For each request: the longest prefix it shares with anything the engine had
seen before it arrived (earlier prompts, and outputs of requests already
finished), within the same cache salt and LoRA, in whole prefix-match units,
capped so the last prompt token is recomputed (vLLM looks up at most
``num_tokens - 1`` tokens). No replay and no vLLM: the trace alone, the
comparison across requests done by polars over exploded per-unit chain hashes.

What "before it arrived" means follows the replay's step clock, given as a
:class:`Clock`: the order in which requests reached the engine's prefix
lookup, the step of that lookup, and the step each finished in (from a
replay: vLLM looks a request up when it is scheduled, so under FCFS this is
arrival order, and under priority scheduling or a full queue a request that
waited can hit a later arrival's prompt that was scheduled first):

- a prompt is seen by every request looked up after it (vLLM caches a
  request's full blocks as it allocates them, before they are computed, so
  being scheduled, not finishing, is the bound an upper limit needs);
- an output is seen by requests looked up in a later step than the one its
  request finished in: only then is it all in the cache. What is seen is the
  prompt and the first ``output_len - 1`` output tokens (the last sampled
  token is never fed back, so it has no KV).

Without a clock (:func:`trace_clock`) timed requests arrive by
``(arrival_step, row)``, an ``after: X`` request right after X, and outputs
are seen only by requests that wait for them through ``after`` chains.

Units are hashed at the prefix-match unit. Block-id traces whose block size
the unit divides are hashed from the block ids (a unit's tokens are a
function of its block's id and its place in it) without making tokens; their
synthetic outputs (``out:<id>`` streams) cannot appear in a block-id prompt,
so they are skipped there. Everything else is hashed from the tokens the
replay feeds vLLM (:mod:`traces.materialize`), outputs included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from traces.model.engine_spec import EngineBlock
from traces.materialize import TokenSource, request_rows
from traces.model.tokens import mix, stream_seed
from traces.trace import Trace

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_UNIT_DOMAIN = np.uint64(0x5EED_0F_0417_0001)
_POS_DOMAIN = np.uint64(0x5EED_0F_0417_0002)
_BLOCK_DOMAIN = np.uint64(0x5EED_0F_0417_0003)


def prefix_match_unit(engine: EngineBlock) -> int:
    """The granularity of prefix hashes: the PMU, else the block sizes' gcd."""
    if engine.prefix_match_unit:
        return int(engine.prefix_match_unit)
    return math.gcd(engine.block_size, *[g.block_size for g in engine.kv_groups])


@dataclass(frozen=True)
class Clock:
    """The replay's step clock for each request: arrival order and steps."""

    order: list[str]                       # request ids in the order they were looked up
    step: dict[str, int]                   # the step of that lookup: non-decreasing in order
    finish_step: dict[str, int | None]     # same clock; None: never finished (aborted, ...)


def trace_clock(trace: Trace) -> Clock:
    """The clock as far as the trace alone tells it (see the module docstring)."""
    rows = request_rows(trace.requests)
    timed = sorted((s or 0, i) for i, s in enumerate(rows.arrival_step) if rows.after[i] is None)
    children: dict[str, list[int]] = {}
    for i, parent in enumerate(rows.after):
        if parent is not None:
            children.setdefault(parent, []).append(i)
    order: list[str] = []
    step: dict[str, int] = {}

    def visit(i: int, at: int) -> None:
        rid = rows.ids[i]
        order.append(rid)
        step[rid] = at
        for j in children.get(rid, ()):
            visit(j, at)

    for s, i in timed:
        visit(i, s)
    # Without a replay no finish is known: outputs count only along after chains.
    return Clock(order=order, step=step, finish_step={rid: None for rid in order})


def _position_weights(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix(_POS_DOMAIN + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN) | np.uint64(1)


class _UnitHasher:
    """Chain hashes ``H_1..H_n`` of a sequence's first n whole units.

    ``H_k`` names the first k units: a position-weighted sum of unit content
    hashes, mixed with the salt/LoRA seed and k (numpy wraps uint64 sums)."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.token_weights = _position_weights(unit)
        self._pos = _position_weights(1024)

    def _weights(self, n: int) -> np.ndarray:
        if n > len(self._pos):
            self._pos = _position_weights(max(n, 2 * len(self._pos)))
        return self._pos[:n]

    def from_tokens(self, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens) // self.unit
        m = np.asarray(tokens[: n * self.unit], dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            content = mix((m.reshape(n, self.unit) * self.token_weights).sum(axis=1,
                                                                                dtype=np.uint64)
                           ^ _UNIT_DOMAIN)
        return content

    def from_block_ids(self, ids: np.ndarray, block: int, length: int) -> np.ndarray:
        per = block // self.unit
        n = length // self.unit
        seeds = np.repeat(np.asarray(ids, dtype=np.int64).astype(np.uint64), per)[:n]
        sub = np.tile(np.arange(1, per + 1, dtype=np.uint64), len(ids))[:n]
        with np.errstate(over="ignore"):
            return mix(mix(seeds ^ _BLOCK_DOMAIN) + sub * _GOLDEN)

    def chain(self, content: np.ndarray, seed: int) -> np.ndarray:
        n = len(content)
        with np.errstate(over="ignore"):
            s = np.cumsum(content * self._weights(n), dtype=np.uint64)
            k = np.arange(1, n + 1, dtype=np.uint64)
            return mix(s ^ np.uint64(seed) ^ mix(k * _GOLDEN))


def _namespace(salt: str | None, lora: str | None) -> int:
    """Requests share cache only within one cache salt and LoRA."""
    return stream_seed(f"salt={salt!r};lora={lora!r}")


def _token_hashed(trace: Trace, unit: int) -> bool:
    """Whether units must be hashed from tokens (else from block ids)."""
    rq = trace.requests
    block = (trace.header.get("prompt_blocks") or {}).get("block_tokens")
    if "prompt_block_ids" not in rq.column_names or not block or block % unit:
        return True
    if "prompt_tokens" in rq.column_names and rq["prompt_tokens"].null_count < rq.num_rows:
        return True
    # Recorded outputs may reappear in later prompts: hash everything as tokens.
    return "output_tokens" in rq.column_names and rq["output_tokens"].null_count < rq.num_rows


def _fed_back(tokens: TokenSource, row: int, output_len: int) -> np.ndarray:
    """The output tokens of row ``row`` that have KV once it finished: its first
    ``output_len - 1`` (the last sampled token is never fed back).

    ``TokenSource.output`` takes the request's own ``output_len`` (the replay
    asks it for exactly that): a recorded trace stores all ``output_len``
    sampled tokens (validated), and they overwrite the first ``output_len``
    of the synthetic stream. Asking it for ``output_len - 1`` only worked for
    synthetic outputs (an ``out:<id>`` stream's prefix is the same at any
    length) and broke on every recorded output. So the replay's tokens are
    made as the replay makes them, then cut to those with KV."""
    return tokens.output(row, output_len, 0)[: output_len - 1]


def reachable_hits(trace: Trace, clock: Clock | None = None) -> pl.DataFrame:
    """Per request, in lookup order: ``id``, ``arrival_pos`` (that order), ``num_prompt_tokens``,
    ``reachable`` (tokens), ``reachable_from`` (the earliest request that held
    that prefix, or null) and ``cap`` (the most vLLM may look up, in whole units)."""
    clock = clock or trace_clock(trace)
    unit = prefix_match_unit(trace.engine)
    rows = request_rows(trace.requests)
    row_of = {rid: i for i, rid in enumerate(rows.ids)}
    tokens = TokenSource(trace.header, trace.requests)
    hasher = _UnitHasher(unit)
    by_tokens = _token_hashed(trace, unit)
    block = (trace.header.get("prompt_blocks") or {}).get("block_tokens")
    blocks = None
    if not by_tokens:
        col = trace.requests["prompt_block_ids"].combine_chunks()
        blocks = (col.offsets.to_numpy(), col.values.to_numpy())

    n = len(clock.order)
    arrivals = np.asarray([clock.step[rid] for rid in clock.order], dtype=np.int64)
    if np.any(np.diff(arrivals) < 0):
        raise ValueError("Clock.step must not decrease along Clock.order")
    pos_of = {rid: p for p, rid in enumerate(clock.order)}
    # Trace-only clock: an output is seen by the requests waiting for it (after chains).
    waiters: dict[str, list[str]] = {}
    if all(v is None for v in clock.finish_step.values()):
        for i, parent in enumerate(rows.after):
            if parent is not None:
                waiters.setdefault(parent, []).append(rows.ids[i])

    look_pos, look_k, look_h = [], [], []
    seen_h, seen_vis, seen_src = [], [], []
    caps = np.zeros(n, dtype=np.int64)
    n_prompt = np.zeros(n, dtype=np.int64)
    for p, rid in enumerate(clock.order):
        i = row_of[rid]
        seed = _namespace(rows.cache_salt[i], rows.lora_name[i])
        n_tok = int(rows.num_prompt_tokens[i])
        n_prompt[p] = n_tok
        out_len = int(rows.output_len[i] or 0)
        finish = clock.finish_step.get(rid)
        out_vis: int | None = None
        if finish is not None and out_len > 1:
            out_vis = int(np.searchsorted(arrivals, finish, side="right"))
        if by_tokens:
            seq = tokens.prompt(i)
            if (out_vis is not None or rid in waiters) and out_len > 1:
                seq = np.concatenate([seq, _fed_back(tokens, i, out_len)])
            content = hasher.from_tokens(seq)
        else:
            off, vals = blocks
            content = hasher.from_block_ids(vals[off[i]:off[i + 1]], block, n_tok)
        h = hasher.chain(content, seed)
        n_prompt_units = n_tok // unit
        cap = (n_tok - 1) // unit
        caps[p] = cap
        look_pos.append(np.full(cap, p, dtype=np.int64))
        look_k.append(np.arange(1, cap + 1, dtype=np.int64))
        look_h.append(h[:cap])
        seen_h.append(h[:n_prompt_units])
        seen_vis.append(np.full(n_prompt_units, p + 1, dtype=np.int64))
        seen_src.append(np.full(n_prompt_units, p, dtype=np.int64))
        if len(h) > n_prompt_units:
            extra = h[n_prompt_units:]
            if out_vis is not None:
                seen_h.append(extra)
                seen_vis.append(np.full(len(extra), out_vis, dtype=np.int64))
                seen_src.append(np.full(len(extra), p, dtype=np.int64))
            for w in waiters.get(rid, ()):          # trace-only: seen by its waiters
                seen_h.append(extra)
                seen_vis.append(np.full(len(extra), pos_of[w], dtype=np.int64))
                seen_src.append(np.full(len(extra), p, dtype=np.int64))

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    lookups = pl.DataFrame({"pos": cat(look_pos, np.int64), "k": cat(look_k, np.int64),
                            "h": cat(look_h, np.uint64)})
    seen = pl.DataFrame({"h": cat(seen_h, np.uint64), "vis": cat(seen_vis, np.int64),
                         "src": cat(seen_src, np.int64)})
    # Each prefix hash: the first position that can see it, and the request that
    # made it visible there. A prefix seen means all its shorter prefixes were
    # seen too, so the longest unit whose hash is visible is the reachable prefix.
    first = seen.group_by("h").agg(pl.col("vis").min(),
                                   pl.col("src").sort_by(["vis", "src"]).first())
    hits = (lookups.join(first, on="h", how="inner")
            .filter(pl.col("vis") <= pl.col("pos"))
            .sort(["pos", "k"])
            .group_by("pos", maintain_order=True)
            .agg(pl.col("k").last().alias("units"), pl.col("src").last()))
    names = pl.DataFrame({"src": np.arange(n, dtype=np.int64), "reachable_from": clock.order})
    base = pl.DataFrame({"pos": np.arange(n, dtype=np.int64), "id": clock.order,
                         "num_prompt_tokens": n_prompt, "cap": caps * unit})
    out = (base.join(hits, on="pos", how="left")
           .join(names, on="src", how="left")
           .with_columns((pl.col("units").fill_null(0) * unit).alias("reachable"))
           .sort("pos"))
    return out.select(pl.col("id"), pl.col("pos").alias("arrival_pos"), "num_prompt_tokens",
                      "reachable", "reachable_from", "cap")


_TOKEN_DOMAIN = np.uint64(0x5EED_0F_0417_0004)


def _token_prefix_hashes(hasher: _UnitHasher, tokens: np.ndarray, seed: int) -> np.ndarray:
    """``P_L`` for L = 1..len(tokens): a hash naming the first L tokens, made of
    the chain hash of its whole units and a position-weighted sum of the rest."""
    n, unit = len(tokens), hasher.unit
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        head = mix(np.asarray([seed], dtype=np.uint64) ^ _TOKEN_DOMAIN)
        prev = np.concatenate([head, hasher.chain(hasher.from_tokens(tokens), seed)])
        length = np.arange(1, n + 1, dtype=np.int64)
        k = (length - 1) // unit
        m = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
        c = np.cumsum(m * hasher.token_weights[(length - 1) % unit], dtype=np.uint64)
        before = np.where(k > 0, c[np.maximum(k * unit - 1, 0)], np.uint64(0))
        return mix(prev[k] ^ mix((c - before) ^ _TOKEN_DOMAIN)
                   ^ mix(length.astype(np.uint64) * _GOLDEN))


def shared_tokens(trace: Trace, clock: Clock | None = None) -> pl.DataFrame | None:
    """Per request, in lookup order: ``id``, ``shared_tokens`` (the longest common
    token prefix with any prompt looked up before it, within one cache salt and
    LoRA, capped at ``num_tokens - 1`` as vLLM's lookup is) and ``shared_from``.

    The token-granular figure beside :func:`reachable_hits`' unit-floored one,
    so a prefix shorter than one unit is said, not read as 0. Each prompt's
    every prefix is hashed (:func:`_token_prefix_hashes`), and a polars
    ``group_by`` plus ``join`` find the longest one seen earlier, as for units.
    None for a trace whose prompts are block ids: identical ids name identical
    whole blocks, so its unit-floored figure is already the token one."""
    clock = clock or trace_clock(trace)
    unit = prefix_match_unit(trace.engine)
    if not _token_hashed(trace, unit):
        return None
    rows = request_rows(trace.requests)
    row_of = {rid: i for i, rid in enumerate(rows.ids)}
    tokens = TokenSource(trace.header, trace.requests)
    hasher = _UnitHasher(unit)
    look_pos, look_h, seen_h, seen_pos = [], [], [], []
    for p, rid in enumerate(clock.order):
        i = row_of[rid]
        seed = _namespace(rows.cache_salt[i], rows.lora_name[i])
        h = _token_prefix_hashes(hasher, tokens.prompt(i), seed)
        look_pos.append(np.full(max(len(h) - 1, 0), p, dtype=np.int64))
        look_h.append(h[:-1])
        seen_h.append(h)
        seen_pos.append(np.full(len(h), p, dtype=np.int64))
    n = len(clock.order)
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
    look = pl.DataFrame({"pos": cat(look_pos, np.int64), "h": cat(look_h, np.uint64)})
    look = look.with_columns(pl.int_range(1, pl.len() + 1).over("pos").alias("len"))
    seen = pl.DataFrame({"h": cat(seen_h, np.uint64), "src": cat(seen_pos, np.int64)})
    first = seen.group_by("h").agg(pl.col("src").min())
    hits = (look.join(first, on="h", how="inner").filter(pl.col("src") < pl.col("pos"))
            .sort(["pos", "len"]).group_by("pos", maintain_order=True)
            .agg(pl.col("len").last().alias("shared_tokens"), pl.col("src").last()))
    names = pl.DataFrame({"src": np.arange(n, dtype=np.int64), "shared_from": clock.order})
    base = pl.DataFrame({"pos": np.arange(n, dtype=np.int64), "id": clock.order})
    return (base.join(hits, on="pos", how="left").join(names, on="src", how="left")
            .sort("pos").select("id", pl.col("shared_tokens").fill_null(0), "shared_from"))
