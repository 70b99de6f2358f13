"""How a hit's outputs are compared with its recompute's, and the threshold.

The comparison side of ``check --recompute`` (:mod:`.reference` makes what
is compared against). Compared, at every prompt position from the hit on
and at every output token (:class:`traces.model.outcome.TopLogprobs`): the
logprob of the token that came next (the prompt's own, or the forced output
token), and the top-K of each run, matched by token id. A token in both top-K
lists gives its exact difference; a token in one list only gives a lower
bound (its logprob in the other run is at most that run's K-th, so they
differ by at least the gap). With K = -1 (the whole vocabulary) every token
is in both lists and the largest difference is exact over the vocabulary.

It fails closed: a NaN or an infinity anywhere, runs of unequal length,
tokens that are not the same in both, a missing or empty comparison raise
:class:`DivergenceError` (naming the request), never a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from replayer.replay.loop import ReplayError
from traces.model.outcome import RequestOutcome, TopLogprobs

MARGIN = 4.0


class DivergenceError(ReplayError):
    """A comparison that cannot be made (a check fails closed: exit 2)."""


@dataclass(frozen=True)
class Crossing:
    """Where two runs differ most at one position, and by which measure."""

    kind: str                # "prompt" (a prompt position) or "output" (an output token)
    position: int            # prompt position, or output token index
    measure: str             # "next token" / "top-K" / "top-K, in one list only"
    token: int
    difference: float        # exact, or a lower bound for "in one list only"

    def said(self, k: int) -> str:
        where = ("prompt position" if self.kind == "prompt" else "output token")
        top = "the whole vocabulary" if k < 0 else f"top-{k}"
        if self.measure == "next token":
            what = f"logprob of its next token {self.token}"
        elif self.measure == "top-K":
            what = f"{top} logprob of token {self.token}"
        else:
            what = f"logprob of token {self.token} (in one {top} list only, so at least)"
        return f"{where} {self.position}: {what} differs by {self.difference:.3g}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, "measure": self.measure,
                "token": self.token, "difference": self.difference}


@dataclass(frozen=True)
class Divergence:
    """One request's hit against its recompute, position by position."""

    largest: float                   # the largest difference at any position, any measure
    first: Crossing | None           # the first position (in sequence order) past the threshold
    prompt_positions: int
    output_tokens: int


def _finite(rid: str, rows: TopLogprobs, who: str, kind: str) -> None:
    bad = ~(np.isfinite(rows.token_logprobs) & np.isfinite(rows.top_logprobs).all(axis=1))
    if bad.any():
        at = rows.first + int(np.flatnonzero(bad)[0])
        raise DivergenceError(f"request {rid!r}: {who}'s logprobs are NaN or infinite at "
                              f"{kind} {'position' if kind == 'prompt' else 'token'} {at}")


def _row_differences(a: TopLogprobs, b: TopLogprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the largest difference, which measure gave it (an index into
    :data:`MEASURES`) and its token."""
    n, k = a.top_ids.shape
    best = np.abs(a.token_logprobs.astype(np.float64) - b.token_logprobs)
    measure, token = np.zeros(n, dtype=np.int64), a.tokens.copy()
    step = max(1, (1 << 22) // max(1, k * k))          # rows at a time: K x K matches each
    for lo in range(0, n if k else 0, step):
        rows = slice(lo, lo + step)
        if k <= 256:
            top, kind, tok = _top_differences(a.top_ids[rows], a.top_logprobs[rows],
                                              b.top_ids[rows], b.top_logprobs[rows])
        else:
            top, kind, tok = _top_differences_sorted(a, b, rows)
        better = top > best[rows]
        best[rows] = np.where(better, top, best[rows])
        measure[rows] = np.where(better, kind, measure[rows])
        token[rows] = np.where(better, tok, token[rows])
    return best, measure, token


def _top_differences(a_ids, a_lps, b_ids, b_lps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The top-K measures of a few rows at once (K small): every pair of ids matched."""
    n = len(a_ids)
    same = a_ids[:, :, None] == b_ids[:, None, :]                   # (n, K, K)
    best, kind, token = np.full(n, -1.0), np.zeros(n, dtype=np.int64), np.zeros(n, np.int64)
    for x_ids, x_lps, y_lps, axis in ((a_ids, a_lps, b_lps, 2), (b_ids, b_lps, a_lps, 1)):
        found = same.any(axis=axis)                                  # x's tokens in y's list
        y_at = np.take_along_axis(y_lps, same.argmax(axis=axis), axis=1).astype(np.float64)
        kth = y_lps.min(axis=1, keepdims=True).astype(np.float64)
        diff = np.where(found, np.abs(x_lps - y_at), np.maximum(x_lps - kth, 0.0))
        col = diff.argmax(axis=1)
        top = diff[np.arange(n), col]
        better = top > best
        best = np.where(better, top, best)
        kind = np.where(better, np.where(found[np.arange(n), col], 1, 2), kind)
        token = np.where(better, x_ids[np.arange(n), col], token)
    return best, kind, token


def _top_differences_sorted(a: TopLogprobs, b: TopLogprobs, rows: slice
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same measures row by row, ids matched by sorting (K large: the whole
    vocabulary, where every token is in both lists)."""
    out = []
    for i in range(*rows.indices(len(a))):
        best = (-1.0, 0, 0)
        for x, y in ((a, b), (b, a)):
            common, xi, yi = np.intersect1d(x.top_ids[i], y.top_ids[i], return_indices=True)
            alone = np.setdiff1d(np.arange(len(x.top_ids[i])), xi)
            exact = np.abs(x.top_logprobs[i][xi].astype(np.float64) - y.top_logprobs[i][yi])
            bound = np.maximum(x.top_logprobs[i][alone] - float(y.top_logprobs[i].min()), 0.0)
            for values, ids, kind in ((exact, common, 1), (bound, x.top_ids[i][alone], 2)):
                if len(values) and float(values.max()) > best[0]:
                    j = int(values.argmax())
                    best = (float(values[j]), kind, int(ids[j]))
        out.append(best)
    top, kind, token = zip(*out) if out else ((), (), ())
    return np.array(top), np.array(kind, dtype=np.int64), np.array(token, dtype=np.int64)


MEASURES = ("next token", "top-K", "top-K, in one list only")


def _compare_rows(rid: str, kind: str, hit: TopLogprobs | None, ref: TopLogprobs | None,
                  first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The hit's rows against the recompute's rows at the same positions (from ``first``)."""
    what = "prompt positions after its hit" if kind == "prompt" else "output tokens"
    if hit is None or ref is None:
        who = "the hit" if hit is None else "its recompute"
        why = (" (a request preempted before its prefill ended reports none)"
               if kind == "prompt" else "")
        raise DivergenceError(f"request {rid!r}: {who} reported no logprobs of its {what}{why}")
    if hit.first != first or ref.first > first:
        raise DivergenceError(f"request {rid!r}: {kind} rows start at {hit.first} in the hit "
                              f"and {ref.first} in its recompute, not at {first}")
    ref = _slice(ref, first - ref.first)
    if len(hit) != len(ref) or hit.top_ids.shape[1] != ref.top_ids.shape[1]:
        raise DivergenceError(f"request {rid!r}: the hit has {len(hit)} {what} of "
                              f"{hit.top_ids.shape[1]} logprobs each, its recompute "
                              f"{len(ref)} of {ref.top_ids.shape[1]}")
    _finite(rid, hit, "the hit", kind)
    _finite(rid, ref, "its recompute", kind)
    if not np.array_equal(hit.tokens, ref.tokens):
        at = first + int(np.flatnonzero(hit.tokens != ref.tokens)[0])
        raise DivergenceError(f"request {rid!r}: the hit and its recompute were given "
                              f"different tokens at {kind} {at}")
    return (*_row_differences(hit, ref), first)


def _slice(rows: TopLogprobs, start: int) -> TopLogprobs:
    return TopLogprobs(rows.first + start, rows.tokens[start:], rows.token_logprobs[start:],
                       rows.top_ids[start:], rows.top_logprobs[start:])


def _prompt_rows(hit: RequestOutcome, ref: RequestOutcome,
                 start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The prompt rows from ``start`` on, compared; none where the hit holds the
    whole prompt but its last token (row i is the distribution of token i + 1, so
    no row follows it: vLLM computes none, and the first output token's
    distribution is then what depends on the cache)."""
    if start >= hit.num_prompt_tokens - 1:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), start
    return _compare_rows(hit.id, "prompt", hit.prompt_logprobs, ref.prompt_logprobs, start)


def compare(hit: RequestOutcome, ref: RequestOutcome, threshold: float,
            start: int | None = None) -> Divergence:
    """``hit`` (a request that resumed from a cached prefix) against ``ref`` (its cold
    recompute): every prompt position from the hit on (from ``start`` where given),
    then every output token."""
    rid = hit.id
    start = (hit.num_cached_tokens or 0) if start is None else start
    if ref.num_cached_tokens:
        raise DivergenceError(f"request {rid!r}: its recompute was served "
                              f"{ref.num_cached_tokens} cached tokens (it must run cold)")
    parts = [("prompt", *_prompt_rows(hit, ref, start)),
             ("output", *_compare_rows(rid, "output", hit.top_logprobs, ref.top_logprobs, 0))]
    sizes = [len(d) for _, d, *_ in parts]
    if not sum(sizes):
        raise DivergenceError(f"request {rid!r}: no position to compare (no output token, "
                              "no prompt position after its hit)")
    largest, crossing = 0.0, None
    for kind, diffs, measure, token, first in parts:
        if not len(diffs):
            continue
        largest = max(largest, float(diffs.max()))
        over = np.flatnonzero(diffs > threshold)
        if crossing is None and len(over):
            i = int(over[0])
            crossing = Crossing(kind, first + i, MEASURES[int(measure[i])], int(token[i]),
                                float(diffs[i]))
    return Divergence(largest, crossing, sizes[0], sizes[1])


def largest_difference(a: RequestOutcome, b: RequestOutcome, start: int) -> float:
    """The largest difference of two cold computations of one request (the
    calibration) over the positions a verdict compares (prompt positions from
    ``start``, its hit, on, and every output token), every measure :func:`compare`
    uses."""
    return compare(a, b, threshold=float("inf"), start=start).largest


def rows_from(outcome: RequestOutcome, start: int) -> RequestOutcome:
    """``outcome`` with its prompt rows from position ``start`` on only (a cold
    reference computes none before the hit it stands for: :mod:`.chunk_cuts`);
    rows missing or starting later are kept as they are, for :func:`compare` to
    refuse."""
    rows = outcome.prompt_logprobs
    if rows is None or rows.first >= start:
        return outcome
    return replace(outcome, prompt_logprobs=_slice(rows, start - rows.first))
