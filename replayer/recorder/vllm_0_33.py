"""Recorder adapter for vLLM 0.33.x: the release the hooks were first written for.

Speculative decoding is recorded as the config says, lookahead block hashes
included (0.33 added them and the flag that turns them off); the
MooncakeStore connector is recorded (:mod:`.connector`).
"""

from __future__ import annotations

from typing import Any

# The names this adapter reads beyond the shared ones (.hooks).
HOOKS = ("vllm.config:SpeculativeConfig.disable_lookahead_block_hashes",
         "vllm.v1.outputs:ModelRunnerOutput.req_id_to_index",
         "vllm.v1.request:Request.skip_reading_prefix_cache")


def output_rows(mro: Any) -> dict[str, int]:
    """Each request's row of the step's sampled tokens (0.34 dropped this map)."""
    return mro.req_id_to_index


def skips_prefix_cache(request: Any) -> bool:
    return bool(request.skip_reading_prefix_cache)


def speculative_block(spec: Any) -> dict[str, Any]:
    return {"method": str(spec.method), "num_speculative_tokens": int(spec.num_speculative_tokens),
            "disable_lookahead_block_hashes": bool(spec.disable_lookahead_block_hashes)}
