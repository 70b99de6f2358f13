"""Recorder adapter for vLLM 0.34 and later.

As 0.33 (:mod:`.vllm_0_33`: lookahead block hashes recorded as the config
says), but for two names 0.34 removed, read in its wheel's ``v1/outputs.py``
and ``v1/request.py``:

* ``ModelRunnerOutput`` has no ``req_id_to_index``: a request's row of
  ``sampled_token_ids`` is its place in ``req_ids`` (the scheduler's own
  ``req_indices`` in ``update_from_output``).
* ``Request.skip_reading_prefix_cache`` became ``prefix_cache_hit_limit``:
  0 where the request reads no cache (``skip_reading_prefix_cache``, or
  prompt logprobs asked without ``prompt_logprob_start``), N where it may
  read only its first N tokens (``prompt_logprob_start``: 0.34's), None
  where unbounded. A trace says only whether a request skips the cache, so a
  request bounded at N > 0 is recorded as one that reads it, with a warning
  naming it (the replay may hit more there than the server did).
"""

from __future__ import annotations

import logging
from typing import Any

from replayer.recorder.vllm_0_33 import speculative_block

__all__ = ["HOOKS", "output_rows", "skips_prefix_cache", "speculative_block"]

HOOKS = ("vllm.config:SpeculativeConfig.disable_lookahead_block_hashes",
         "vllm.v1.outputs:ModelRunnerOutput.req_ids",
         "vllm.v1.request:Request.prefix_cache_hit_limit")

log = logging.getLogger("vllm.prefix_replayer")   # vLLM's handler: the server's log


def output_rows(mro: Any) -> dict[str, int]:
    """Each request's row of the step's sampled tokens."""
    return {rid: i for i, rid in enumerate(mro.req_ids)}


def skips_prefix_cache(request: Any) -> bool:
    limit = request.prefix_cache_hit_limit
    if limit:
        log.warning("prefix-replayer recorder: request %s may read only its first %d "
                    "token(s) from the prefix cache (prompt_logprob_start); a trace "
                    "cannot say so, and records it as a request that reads the cache",
                    request.request_id, limit)
    return limit == 0
