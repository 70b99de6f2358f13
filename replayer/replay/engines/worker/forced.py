"""The forced-tokens seam: a real runner's sampled tokens held to the trace's.

vLLM's own trace replay (``SamplingParams.trace_decode_token_ids``, #46701)
lives in the V2 model runner's sampler, which needs Triton; the CPU runner
here is V1. This seam does what vLLM's does, in the V1 runner's sampler: the
real logits are computed, the real sampler samples, then each request's
sampled token is overwritten with the trace's output token at that position,
and only then are logprobs gathered, so vLLM reports the logprob and rank of
the forced token under the model's own distribution. Two methods of the
runner's objects are wrapped on the instance, nothing else:

* ``Sampler.sample``: the sampled token of every request is the trace's (with
  speculative decoding, the bonus token after the drafts);
* ``rejection_sample`` (the module function ``RejectionSampler.forward``
  calls): the target's token at each draft position is the trace's (its
  greedy choice is made to be that token on a copy of the processed logits;
  logprobs come from the raw ones), so vLLM's real rejection sampler accepts a
  draft exactly when it equals the trace's next token.

Which drafts it sees is the draft seam (:meth:`ForcedTokens.drafts`): the
drafter runs for real, then its proposals are replaced by the trace's next
tokens, all of them, or with a recording's acceptance held, as many as the
recording accepted followed by a token that cannot match.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from replayer.replay.engines.base import EngineError, held_acceptance


class ForcedTokenError(EngineError):
    """The trace cannot say which token a request's row is forced to: the seam
    refuses rather than let the model's own choice through."""


class ForcedTokens:
    """The trace's tokens for a V1 model runner's rows, and its drafts.

    ``outputs``: request id -> the trace's output tokens (longer than the
    request's output, as the null executor has them). ``num_outputs``: request
    id -> output tokens committed so far (the scheduler's count, read while
    a step runs, before the step's tokens are added)."""

    def __init__(self, outputs: dict[str, list[int]], num_outputs: Callable[[str], int],
                 vocab_size: int) -> None:
        self.outputs = outputs
        self.num_outputs = num_outputs
        self.vocab_size = vocab_size
        self.accepted: dict[tuple[str, int], int] | None = None
        self.verified: dict[str, int] = {}
        self._bonus_offsets: list[int] | None = None

    # -- the trace's tokens ------------------------------------------------------
    def _token(self, rid: str, offset: int) -> int:
        """The trace's token ``offset`` places after ``rid``'s committed outputs."""
        out = self.outputs.get(rid)
        i = self.num_outputs(rid) + offset
        if out is None:
            raise ForcedTokenError(f"forced tokens: request {rid!r} is sampled but the trace "
                                   "gives it no output tokens")
        if i >= len(out):
            raise ForcedTokenError(f"forced tokens: request {rid!r} is sampled at output "
                                   f"{i}, and the trace gives it {len(out)} token(s)")
        return out[i]

    def install(self, runner: Any) -> None:
        """Wrap the runner's sampler (and rejection sampler) on this instance."""
        sampler = runner.sampler
        real_sample = sampler.sample

        def sample(logits, sampling_metadata, *args, **kwargs):
            sampled, processed = real_sample(logits, sampling_metadata, *args, **kwargs)
            req_ids = runner.input_batch.req_ids
            offsets = self._bonus_offsets or [0] * len(req_ids)
            forced = [self._token(rid, off) for rid, off in zip(req_ids, offsets)]
            sampled.copy_(torch.tensor(forced, dtype=sampled.dtype))
            return sampled, processed

        sampler.sample = sample
        if getattr(runner, "rejection_sampler", None) is not None:
            self._install_rejection(runner)

    def _install_rejection(self, runner: Any) -> None:
        import vllm.v1.sample.rejection_sampler as rs

        rejection = runner.rejection_sampler
        real_forward = rejection.forward

        def forward(metadata, draft_probs, logits, sampling_metadata):
            counts = list(metadata.num_draft_tokens)
            req_ids = runner.input_batch.req_ids[:len(counts)]
            for rid, n in zip(req_ids, counts):
                if n:
                    self.verified[rid] = self.verified.get(rid, 0) + 1
            self._bonus_offsets = counts
            self._targets = [(rid, self._token(rid, j)) for rid, n in zip(req_ids, counts)
                             for j in range(n)]
            try:
                return real_forward(metadata, draft_probs, logits, sampling_metadata)
            finally:
                self._bonus_offsets = None
                self._targets = None

        rejection.forward = forward
        if getattr(rs, "_replayer_forced", None) is None:
            real_rejection_sample = rs.rejection_sample

            def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len,
                                 cu_num_draft_tokens, draft_probs, target_logits, *args,
                                 **kwargs):
                owner = rs._replayer_forced
                if owner is not None and owner._targets is not None:
                    target_logits = owner.force_argmax(target_logits, owner._targets)
                return real_rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len,
                                             cu_num_draft_tokens, draft_probs, target_logits,
                                             *args, **kwargs)

            rs.rejection_sample = rejection_sample
        rs._replayer_forced = self
        self._targets = None

    @staticmethod
    def force_argmax(target_logits: torch.Tensor, targets: list[tuple[str, int]]) -> torch.Tensor:
        """A copy of the processed target logits whose greedy choice at each draft
        position (row) is the trace's token: ``targets`` gives (request, token) per
        row. The forced logit is the largest finite value of the logits' dtype, so no
        rounding can tie it (``top + 1.0`` rounds back to ``top`` in bf16 above 256);
        a row where another logit still reaches it (an infinity, a NaN) is refused."""
        forced = target_logits.clone()
        if not targets:
            return forced
        idx = torch.arange(len(targets))
        tok = torch.tensor([t for _, t in targets])
        high = torch.finfo(forced.dtype).max
        forced[idx, tok] = high
        rows = forced[idx]
        tied = ((rows >= high) | rows.isnan()).sum(dim=-1) != 1
        if bool(tied.any()):
            i = int(torch.nonzero(tied)[0])
            raise ForcedTokenError(f"forced tokens: request {targets[i][0]!r}: another logit "
                                   f"ties token {targets[i][1]} at the largest "
                                   f"{forced.dtype} value (an infinity or a NaN)")
        return forced

    # -- the draft seam ----------------------------------------------------------
    def drafts(self, req_ids: list[str], num_spec: int) -> list[list[int]]:
        """The drafts each request proposes next: the trace's next ``num_spec``
        tokens, cut after the recorded acceptance by one that cannot match."""
        out = []
        for rid in req_ids:
            tokens = self.outputs.get(rid, [])
            n = self.num_outputs(rid)
            true = list(tokens[n:n + num_spec])
            if self.accepted is not None and true:
                keep = held_acceptance(self.accepted, rid, self.verified.get(rid, 0), num_spec)
                if keep < len(true):
                    true[keep] = (true[keep] + 1) % self.vocab_size
            out.append(true)
        return out


def forced_for(adapter: Any, vllm_config: Any) -> ForcedTokens:
    """The trace's tokens for the engine ``adapter`` builds, as every executor here forces them
    (one process or each rank): outputs from the trace, counts from vLLM's own requests."""
    return ForcedTokens(
        adapter._outputs, lambda rid: adapter.scheduler.requests[rid].num_output_tokens,
        vllm_config.model_config.get_vocab_size())
