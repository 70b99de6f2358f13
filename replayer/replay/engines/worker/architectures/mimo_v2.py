"""MiMo-V2-Flash (two KV shapes): the tiny model of a trace whose groups have two block sizes.

vLLM gives every attention layer the engine's block size, then, where layers
hold different KV bytes a token, raises the block size of those with the
smaller page until every page is as large as the largest
(``v1/core/kv_cache_utils.py``, ``unify_kv_cache_spec_page_size``). So
KV-cache groups of two block sizes (full attention in 32-token blocks beside a
window in 16-token ones) come from a model whose layers differ in KV bytes a
token. vLLM's MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, ``mimo_v2.py``) is
one: its sliding-window layers (``hybrid_layer_pattern`` 1) take their own KV
heads (``swa_num_key_value_heads``), its global ones ``num_key_value_heads``.

The tiny one has a layer per layer of the null executor's plan, in its order
(the twins included), each group's KV heads its largest block over its own
block (so the group with the smaller blocks holds the wider rows and vLLM
raises the other's block to the trace's); dense MLPs (no ``moe_layer_freq``:
no expert routing to flip with a last bit), no attention sinks, V heads as
wide as K (vLLM takes its CPU attention then, not a DiffKV backend), no value
scale; fp32, hidden 64, heads of 32, as the tiny Llama.

Its EAGLE head is the one-layer Llama head, shaped as the layers of the group
the trace puts the draft in (``speculative.draft_group``): in a window group
its layer is a ``sliding_attention`` one (``layer_types`` read from
``target_layer_count``, as vLLM's Llama reads a draft's), so vLLM puts it in
that group. MiMo-V2's own MTP layer (``mimo_v2_mtp.py``, ``MiMoV2MTPLayer``)
always takes the sliding-window shape; a trace with an MTP draft in another
group is refused. No seam of its own.

Nothing here imports vLLM or :mod:`..models`.
"""

from __future__ import annotations

from typing import Any

from traces.model.engine_spec import EngineBlock

ARCHITECTURE = "MiMoV2FlashForCausalLM"
HIDDEN = 64
HEAD_DIM = 32           # the CPU attention's smallest
KINDS = {"full_attention", "sliding_window"}


def serves(engine: EngineBlock) -> bool:
    """Whether this is the tiny model for ``engine``: full attention and sliding
    windows in groups of more than one block size."""
    kinds = {g.kind for g in engine.kv_groups}
    return kinds == KINDS and len({g.block_size for g in engine.kv_groups}) > 1


def _block(engine: EngineBlock, kind: str) -> set[int]:
    return {g.block_size for g in engine.kv_groups if g.kind == kind}


def _draft_group(engine: EngineBlock) -> int:
    """The group the trace puts the draft's layer in (the null executor's rule:
    ``speculative.draft_group``, else the first full-attention group)."""
    spec = engine.speculative
    if spec.draft_group is not None:
        return spec.draft_group
    return next(i for i, g in enumerate(engine.kv_groups) if g.kind == "full_attention")


def refusal(engine: EngineBlock) -> str | None:
    """What of such a trace the tiny MiMo-V2 does not take (None: all)."""
    for kind in sorted(KINDS):
        if len(_block(engine, kind)) > 1:
            return (f"{kind} groups of block sizes {sorted(_block(engine, kind))} (the "
                    "tiny model of two KV shapes, MiMo-V2, has one shape a kind)")
    windows = {g.sliding_window for g in engine.kv_groups if g.kind == "sliding_window"}
    if len(windows) > 1:
        return f"sliding windows of {sorted(windows)} tokens (one window a model)"
    if engine.tensor_parallel_size != 1:
        return (f"tensor_parallel_size {engine.tensor_parallel_size} beside groups of two "
                "block sizes (the tiny MiMo-V2 runs at TP 1 only)")
    if engine.connector:
        return "a connector beside groups of two block sizes (not tried with the tiny MiMo-V2)"
    spec = engine.speculative
    if spec is None or spec.method == "eagle":
        return None
    if spec.method == "mtp":
        group = engine.kv_groups[_draft_group(engine)]
        where = f"the trace has it in the {group.kind} group {_draft_group(engine)}"
        if group.kind == "sliding_window":
            where += " (not tried)"
        return ("speculative method mtp beside groups of two block sizes: the tiny model of "
                "two KV shapes is MiMo-V2, whose MTP layer (vLLM's mimo_v2_mtp.py, "
                "MiMoV2MTPLayer) takes its sliding-window attention's KV heads and window, so "
                f"vLLM puts it in the sliding_window group; {where}")
    return (f"speculative method {spec.method} beside groups of two block sizes (the tiny "
            "MiMo-V2 takes an EAGLE head)")


def kv_heads(engine: EngineBlock) -> dict[str, int]:
    """KV heads of each kind's layers: its largest block over its own, so that
    every layer's page holds the same bytes at the trace's block sizes."""
    largest = max(g.block_size for g in engine.kv_groups)
    return {kind: largest // next(iter(_block(engine, kind))) for kind in KINDS}


def config(engine: EngineBlock, layers: list[str],
           common: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``config.json`` and dtype: a global or sliding-window layer per layer of the
    null executor's plan, in its order."""
    heads = kv_heads(engine)
    window = next(g.sliding_window for g in engine.kv_groups if g.kind == "sliding_window")
    pattern = [int(k == "sliding_window") for k in layers]
    rope_theta = common.get("rope_theta", 10000.0)
    cfg = {"architectures": [ARCHITECTURE], "model_type": "mimo_v2_flash",
           "hidden_size": HIDDEN, "intermediate_size": 128, "hidden_act": "silu",
           "num_attention_heads": max(2, heads["full_attention"]),
           "num_key_value_heads": heads["full_attention"],
           "head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM,
           "swa_num_attention_heads": max(2, heads["sliding_window"]),
           "swa_num_key_value_heads": heads["sliding_window"],
           "swa_head_dim": HEAD_DIM, "swa_v_head_dim": HEAD_DIM,
           "hybrid_layer_pattern": pattern,
           "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
           "mlp_layer_types": ["dense"] * len(layers),
           "sliding_window": window, "sliding_window_size": window,
           "attention_bias": False, "attention_value_scale": None,
           "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
           "rope_theta": rope_theta, "swa_rope_theta": rope_theta,
           "layernorm_epsilon": 1e-5, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           **{k: v for k, v in common.items() if k != "rope_theta"}}
    return cfg, "float32"


def draft_config(target: dict[str, Any], engine: EngineBlock) -> dict[str, Any]:
    """A one-layer EAGLE head (Llama) as wide as the target, its attention shaped as
    the layers of the trace's draft group, so that vLLM puts its layer there."""
    sliding = engine.kv_groups[_draft_group(engine)].kind == "sliding_window"
    prefix = "swa_" if sliding else ""
    cfg = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama",
           "hidden_size": target["hidden_size"], "intermediate_size": 128,
           "num_attention_heads": target[f"{prefix}num_attention_heads"],
           "num_key_value_heads": target[f"{prefix}num_key_value_heads"],
           "head_dim": target[f"{prefix}head_dim"], "num_hidden_layers": 1,
           "vocab_size": target["vocab_size"],
           "max_position_embeddings": target["max_position_embeddings"],
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "torch_dtype": target["torch_dtype"], "tie_word_embeddings": False}
    if sliding:
        # vLLM's Llama attention reads a draft layer's type at its index less
        # target_layer_count (the EAGLE head's layers are numbered after the target's).
        cfg.update({"layer_types": ["sliding_attention"],
                    "sliding_window": target["sliding_window"],
                    "target_layer_count": target["num_hidden_layers"]})
    return cfg


def check_draft_group(engine: EngineBlock, layer_names: list[list[str]], label: str) -> None:
    """The group vLLM put the EAGLE head's layer in, held to the trace's draft
    group: ``layer_names`` is each group's layers in vLLM's order. The head's
    layer is numbered after every target layer (``model.layers.<N>``, vLLM's
    ``start_layer_id``), so it is the highest-numbered one. vLLM 0.32 drops an
    EAGLE block from every group whichever holds it, so the hits alone would not
    show a head in the wrong group."""
    from replayer.replay.engines.base import UnsupportedByEngine

    def index(name: str) -> int:
        parts = name.split(".")
        return int(parts[parts.index("layers") + 1])

    made = max(range(len(layer_names)), key=lambda i: max(map(index, layer_names[i])))
    wanted = _draft_group(engine)
    if made != wanted:
        raise UnsupportedByEngine(
            f"{label}: the model worker cannot replay this trace: vLLM put the tiny EAGLE "
            f"head's layer in KV-cache group {made}, the trace has it in group {wanted} "
            "(--worker null replays it)")
