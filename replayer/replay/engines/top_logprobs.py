"""The distributions ``check --recompute`` compares, collected from vLLM's outputs.

Where a replay asks for them (``Trace.logprob_topk``), every request is sent
with vLLM's own ``SamplingParams(logprobs=K, prompt_logprobs=K,
skip_reading_prefix_cache=False)``. vLLM turns ``skip_reading_prefix_cache`` on
by itself whenever prompt logprobs are asked ("the output of prompt logprobs
may [be] less than n_prompt_tokens"), so that such a request never hits: that
would leave nothing to check. Said ``False`` explicitly, the request reads the
cache as any other, and vLLM's runner computes prompt logprobs from where its
computation starts (``num_computed_tokens`` at its first chunk: the hit) to
the end of the prompt; the rows before it are left unwritten. So the rows
kept are those from the request's hit on, which are exactly the positions a
wrong hit shows at first. A request preempted before its prompt rows came
(its rows may mix two prefills) keeps none.

Every output row comes from ``EngineCoreOutput.new_logprobs`` (column 0: the
forced token, then the top K) and the prompt rows from
``new_prompt_logprobs_tensors`` (column 0: the next prompt token).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from traces.model.outcome import TopLogprobs


def _rows(first: int, ids: Any, logprobs: Any, width: int) -> TopLogprobs:
    """Rows of ``width`` columns (the token, then the top K); none (a prompt cached
    whole: vLLM computes no prompt row after such a hit) keeps its width."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1, width)
    values = np.asarray(logprobs, dtype=np.float32).reshape(-1, width)
    return TopLogprobs(first=first, tokens=ids[:, 0].copy(), token_logprobs=values[:, 0].copy(),
                       top_ids=ids[:, 1:].copy(), top_logprobs=values[:, 1:].copy())


class TopLogprobCollector:
    """Each request's output and prompt rows, from its outputs step by step, handed
    on once it finishes."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._hit: dict[str, int] = {}
        self._requests: dict[str, Any] = {}         # vLLM's Request, for its preemptions
        self._outputs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._prompt: dict[str, TopLogprobs | None] = {}

    def sampling_args(self) -> dict[str, Any]:
        """What each request's ``SamplingParams`` asks of vLLM."""
        return {"logprobs": self.k, "prompt_logprobs": self.k,
                "skip_reading_prefix_cache": False}

    def added(self, rid: str, request: Any) -> None:
        self._requests[rid] = request

    def prefilled(self, rid: str, num_cached_tokens: int) -> None:
        self._hit[rid] = num_cached_tokens

    def output_rows(self, rid: str, lists: Any) -> None:
        """A step's ``new_logprobs`` (vLLM's ``LogprobsLists``) for ``rid``."""
        self._outputs.setdefault(rid, []).append(
            (np.asarray(lists.logprob_token_ids), np.asarray(lists.logprobs)))

    def prompt_rows(self, rid: str, tensors: Any) -> None:
        """``new_prompt_logprobs_tensors`` (vLLM's ``LogprobsTensors``, one row per
        prompt position but the last): the rows from the hit on."""
        first = self._hit.get(rid)
        request = self._requests.get(rid)
        if first is None or request is None or request.num_preemptions > 0:
            self._prompt[rid] = None
            return
        self._prompt[rid] = _rows(first, tensors.logprob_token_ids[first:].numpy(),
                                  tensors.logprobs[first:].numpy(), self.k + 1)

    def finished(self, rid: str) -> tuple[TopLogprobs | None, TopLogprobs | None]:
        """``rid``'s (output rows, prompt rows), forgotten here."""
        self._hit.pop(rid, None)
        self._requests.pop(rid, None)
        parts = self._outputs.pop(rid, [])
        outputs = None
        if parts:
            outputs = _rows(0, np.concatenate([ids for ids, _ in parts]),
                            np.concatenate([lps for _, lps in parts]), self.k + 1)
        return outputs, self._prompt.pop(rid, None)

    def forget(self, rid: str) -> None:
        self.finished(rid)
