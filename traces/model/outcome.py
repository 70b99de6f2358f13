"""What a replay observed for one request: the one outcome type.

Its prefill fields are the ``outcomes`` table's columns
(:data:`traces.model.schema.OUTCOME_FIELDS`), the fields goldens pin, ``diff``
compares and recordings hold; the replay adds where the request sat on the
step clock. Everything that reads or prints an outcome reads this type.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from traces.model.schema import OUTCOME_FIELDS


@dataclass(frozen=True, eq=False)
class TopLogprobs:
    """The model's next-token distribution at consecutive positions of one request,
    as vLLM reports it (``SamplingParams.logprobs`` / ``prompt_logprobs``): per row,
    the token that came next and its logprob, and the K most likely tokens with
    theirs. Rows are positions ``first``, ``first + 1``, ...: output rows count
    output tokens (row 0 chose output token 0); prompt rows count prompt
    positions (row ``i`` is the distribution after prompt token ``i``, which
    chose prompt token ``i + 1``). Kept as arrays: a long prompt has a row per
    token."""

    first: int
    tokens: np.ndarray              # int64 (rows,): the token that came next
    token_logprobs: np.ndarray      # float32 (rows,): its logprob
    top_ids: np.ndarray             # int64 (rows, K), most likely first
    top_logprobs: np.ndarray        # float32 (rows, K)

    def __len__(self) -> int:
        return len(self.tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"first": self.first, "tokens": self.tokens.tolist(),
                "token_logprobs": self.token_logprobs.tolist(),
                "top_ids": self.top_ids.tolist(), "top_logprobs": self.top_logprobs.tolist()}


@dataclass(slots=True)
class RequestOutcome:
    """One request of a replay, in the order ``--json`` prints it."""

    id: str
    arrival_step: int                       # the step before which it entered
    num_prompt_tokens: int
    # What vLLM's prefill_stats said; None until the request was prefilled.
    num_cached_tokens: int | None = None
    num_local_cached_tokens: int | None = None
    num_external_cached_tokens: int | None = None
    prefill_step: int | None = None
    finish_step: int | None = None
    aborted: bool = False
    # What each KV-cache group alone could have served (adapters that can tell).
    group_hits: list[int] | None = None
    # The model's logprob of each output token (forced to the trace's), where a
    # real model ran (replayer --worker model); None on the null executor.
    logprobs: list[float] | None = None
    # The distributions ``check --recompute`` compares (asked of the model worker
    # only; None otherwise): the top-K at each output token, and at each prompt
    # position from the hit on (:class:`TopLogprobs`).
    top_logprobs: TopLogprobs | None = field(default=None, compare=False)
    prompt_logprobs: TopLogprobs | None = field(default=None, compare=False)

    def observed(self) -> dict[str, int | None]:
        """The prefill fields (:data:`OUTCOME_FIELDS`), as goldens name them."""
        return {f: getattr(self, f) for f in OUTCOME_FIELDS}

    def hits(self) -> dict[str, int | None]:
        """Cached tokens and their local/external split: what ``diff`` compares."""
        return {f: getattr(self, f) for f in HIT_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.group_hits is None:
            del out["group_hits"]
        else:
            out["group_hits"] = list(self.group_hits)
        if self.logprobs is None:
            del out["logprobs"]
        else:
            out["logprobs"] = list(self.logprobs)
        for name in ("top_logprobs", "prompt_logprobs"):
            value = out.pop(name)
            if value is not None:
                out[name] = value.as_dict()
        return out


# The prefill fields other than the prompt length: what makes two engines differ.
HIT_FIELDS = OUTCOME_FIELDS[1:]

_MISSING = set(OUTCOME_FIELDS) - {f.name for f in fields(RequestOutcome)}
if _MISSING:  # pragma: no cover - a schema change must come here too
    raise ImportError(f"RequestOutcome lacks outcome columns {sorted(_MISSING)}")
