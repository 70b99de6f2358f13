"""The tiny models a real worker runs: one per trace geometry, written as vLLM reads them.

The null executor reports one hand-made KV-cache layer per group; a real worker
reports the layers of a real model. So the model must have the trace's
geometry: one layer of the right kind for each layer the null executor would
report (:func:`replayer.replay.engines.config.engine_config.plan_layers`, twins
included), in the same order, so that vLLM's own grouping
(``_get_kv_cache_groups_uniform_page_size``) makes the same KV-cache groups
from it. Which architecture serves which kinds:

* full attention only: Llama (fp32);
* full attention beside sliding windows: Llama with ``layer_types``
  (``sliding_attention``), one window;
* full attention beside Mamba groups: Qwen3-Next (gated DeltaNet linear
  attention, vLLM's Mamba-style state manager), bf16, the smallest linear
  head sizes vLLM's CPU kernels take (64);
* sliding windows beside Mamba groups, no full attention: Nemotron-H
  (Mamba2 and windowed attention, :mod:`.architectures.nemotron_h`), fp32;
* chunked local attention, alone or beside full attention: Llama 4 (its RoPE
  layers chunked, its NoPE layers global, :mod:`.architectures.llama4`), fp32;
* full attention beside a sliding window in groups of two block sizes:
  MiMo-V2-Flash (its windowed layers of other KV heads than its global ones,
  :mod:`.architectures.mimo_v2`), fp32;
* the EAGLE draft: a one-layer Llama EAGLE head of the target's width.

A geometry the CPU worker cannot take is refused in one line naming why
(:class:`NotOnThisWorker`), before vLLM is imported. After the engine is built
the groups vLLM made are held to the trace's (:func:`check_groups`), so a
model that gave other groups never replays.

Only :func:`target_config` imports vLLM (through the null executor's layer
plan); :func:`check_geometry` can refuse a trace before. Directories are content-addressed under the cache
(``models/<digest>``), written once and shared by every process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.engines.worker.architectures import llama4, nemotron_h
from replayer.replay.engines.worker.architectures import drafts
from replayer.replay.engines.worker.architectures import kimi_linear
from replayer.replay.engines.worker.architectures import mimo_v2
from traces.model.engine_spec import EngineBlock

# Qwen3-Next's gated DeltaNet on vLLM's CPU kernels (bf16 only: "CPU GDN
# attention requires BF16"): head sizes below 64 are refused ("Unexpected head
# dim size"). One head of each: its cost grows with heads x key x value size.
GDN_HEADS = {"linear_num_key_heads": 1, "linear_num_value_heads": 1,
             "linear_key_head_dim": 64, "linear_value_head_dim": 64,
             "linear_conv_kernel_dim": 4}
ATTENTION_HEAD_DIM = 32       # of the hybrid model's attention layers (CPU: 32 and up)
HYBRID_HIDDEN = 128           # the narrowest width Qwen3-Next's projections take
# Bytes of one GDN layer's state (conv state + fp32 recurrent state), to size
# the attention heads so one attention block holds at least one state page,
# as vLLM requires (it would otherwise raise the block size above the trace's).
_GDN_STATE_BYTES = (
    (2 * GDN_HEADS["linear_num_key_heads"] * GDN_HEADS["linear_key_head_dim"]
     + GDN_HEADS["linear_num_value_heads"] * GDN_HEADS["linear_value_head_dim"])
    * (GDN_HEADS["linear_conv_kernel_dim"] - 1) * 2
    + GDN_HEADS["linear_num_value_heads"] * GDN_HEADS["linear_key_head_dim"]
    * GDN_HEADS["linear_value_head_dim"] * 4)


# A store pool set below this (engine.mooncake_global_segment_size) is there to
# make the store evict, in bytes of the null executor's KV blocks (256 bytes a
# block in the fixtures); a tiny model's blocks hold other bytes (the Llama's
# 4 KiB at block 16). With one KV-cache group at TP 1 every key of either worker
# holds one block of that group, so the pool is scaled by the model's block bytes
# over the null executor's (worker/store.py, pool_in_model_bytes) and holds the
# same number of keys; with more groups their blocks grow by different factors,
# so other keys would be evicted: refused. The one recorded pool (512 MiB)
# evicts nothing under either.
STORE_POOL_FLOOR = 64 * 2**20

# DCP splits a decode's context over ranks and merges their partial attentions by
# each one's softmax LSE; vLLM asks the attention implementation for it.
DCP_ON_CPU = (
    "vLLM's CPU attention (v1/attention/backends/cpu_attn.py, CPUAttentionBackendImpl) "
    "sets no can_return_lse_for_decode, so v1/worker/cp_utils.py "
    "check_attention_cp_compatibility refuses DCP (it needs the softmax LSE of each "
    "decode), and the CPU platform selects that backend for every non-MLA model; of "
    "vLLM's other non-MLA attentions only FlashAttentionImpl (flash_attn.py, CUDA "
    "kernels) returns it, and TritonAttentionImpl does not (MLA: TritonMLAImpl does, "
    "and runs here)")


class NotOnThisWorker(UnsupportedByEngine):
    """The trace's geometry has no tiny model the CPU worker can run."""


@dataclass(frozen=True)
class WorkerModels:
    """What the engine config points at: the target, its draft, their dtype."""

    target: Path
    draft: Path | None
    dtype: str
    architecture: str


def _refuse(label: str, why: str) -> NotOnThisWorker:
    return NotOnThisWorker(f"{label}: the model worker cannot replay this trace: {why} "
                           "(--worker null replays it)")


def refusal(engine: EngineBlock) -> str | None:
    """Why the model worker cannot replay ``engine`` (None: it can): what no tiny
    model here can take, known before vLLM is imported."""
    kinds = [g.kind for g in engine.kv_groups]
    if kimi_linear.serves(set(kinds)):
        return kimi_linear.refusal(engine)
    if engine.model == "kimi-k3" or engine.kda_prefill_backend is not None:
        return ("Kimi-K3's shape (engine.model, engine.kda_prefill_backend) without an "
                "MLA group (the tiny KDA model here has MLA beside it)")
    if engine.decode_context_parallel_size != 1:
        return (f"decode_context_parallel_size {engine.decode_context_parallel_size}: "
                + DCP_ON_CPU)
    if llama4.serves(set(kinds)):
        return llama4.refusal(engine)
    if mimo_v2.serves(engine):
        return mimo_v2.refusal(engine)
    other = sorted(set(kinds) - {"full_attention", "mamba", "sliding_window"})
    if other:
        return (f"KV-cache group kind {other[0]} (tiny models here have full "
                "attention, sliding windows, chunked local attention and Mamba-style "
                "state only)")
    if set(kinds) == {"sliding_window", "mamba"}:
        why = nemotron_h.refusal(engine)
        if why is not None:
            return why
    elif "full_attention" not in kinds:
        return "no full_attention group (every tiny model here has one)"
    elif "mamba" in kinds and "sliding_window" in kinds:
        return ("full-attention, Mamba and sliding-window groups in one model (no "
                "tiny model here has all three)")
    windows = {g.sliding_window for g in engine.kv_groups if g.kind == "sliding_window"}
    if len(windows) > 1:
        return (f"sliding windows of {sorted(windows)} tokens (one window a model)")
    sizes = {g.block_size for g in engine.kv_groups}
    if len(sizes) > 1:
        return (f"KV-cache groups with block sizes {sorted(sizes)} (vLLM makes them "
                "from layers of different KV bytes a token, raising the smaller "
                "page's block size: v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size; "
                "the one tiny model here of two KV shapes, MiMo-V2, has full attention "
                "beside a sliding window)")
    pool = engine.mooncake_global_segment_size
    if engine.connector and pool is not None and pool < STORE_POOL_FLOOR and (
            len(engine.kv_groups) > 1 or engine.tensor_parallel_size > 1):
        return (f"engine.mooncake_global_segment_size {pool} bytes: a store pool that "
                "small evicts by bytes of the null executor's KV blocks, and a tiny "
                "model's blocks hold other bytes (scaled to the model's for one "
                f"KV-cache group at TP 1; here {len(engine.kv_groups)} groups at TP "
                f"{engine.tensor_parallel_size})")
    spec = engine.speculative
    why = drafts.refusal(engine)
    if why is not None:
        return why
    if spec is not None and spec.draft_group is not None:
        return ("speculative.draft_group (a real draft's layer joins the group "
                "of its own spec)")
    return None


def check_geometry(engine: EngineBlock, label: str) -> None:
    """Refuse, before vLLM is imported, what :func:`refusal` says no tiny model takes."""
    why = refusal(engine)
    if why is not None:
        raise _refuse(label, why)


def _target_layers(engine: EngineBlock) -> list[str]:
    """The target's layer kinds, in the null executor's order (twins included)."""
    from replayer.replay.engines.config.engine_config import plan_layers   # imports vLLM

    return [p.kind for p in plan_layers(engine, 2) if not p.draft]


def _attention_kv_heads(block: int) -> int:
    """KV heads of the hybrid attention layers: enough that one block's page
    holds a Mamba state page (vLLM's hybrid page alignment)."""
    heads = 1
    while block * 2 * heads * ATTENTION_HEAD_DIM * 2 < _GDN_STATE_BYTES:
        heads *= 2
    return heads


def _null_kv_heads(tp: int) -> int:
    """The null executor's model's KV heads at TP ``tp`` (tiny-llama's 1 up to TP 2,
    tiny-llama-tp8's 8 above): vLLM's MooncakeStore worker stripes a group's puts
    over ``tp // kv_heads`` ranks, so the tiny model must have as many for both
    workers to write the same keys."""
    return 8 if tp > 2 else 1


def target_config(engine: EngineBlock) -> tuple[dict[str, Any], str]:
    """The target's ``config.json`` and dtype for a checked geometry."""
    layers = _target_layers(engine)
    max_pos = max(engine.max_model_len or 0, 4096)
    common = {"vocab_size": engine.vocab_size, "max_position_embeddings": max_pos,
              "rope_theta": 10000.0, "tie_word_embeddings": False,
              "num_hidden_layers": len(layers)}
    tp = engine.tensor_parallel_size
    if kimi_linear.serves(set(layers)):
        return kimi_linear.target_config(engine, layers)
    if llama4.serves(set(layers)):
        chunk = next(g.attention_chunk_size for g in engine.kv_groups
                     if g.kind == "chunked_local")
        return llama4.config(layers, chunk, common)
    if mimo_v2.serves(engine):
        return mimo_v2.config(engine, layers, common)
    if "mamba" in layers and "full_attention" not in layers:
        window = next(g.sliding_window for g in engine.kv_groups
                      if g.kind == "sliding_window")
        return nemotron_h.config(layers, window, engine.kv_groups[0].block_size, common)
    if "mamba" in layers:
        kv = max(_attention_kv_heads(engine.kv_groups[0].block_size), _null_kv_heads(tp))
        # At TP N each rank holds its share of every head: N linear heads (one a rank,
        # as at TP 1) and attention heads a multiple of N.
        gdn = {**GDN_HEADS, "linear_num_key_heads": tp, "linear_num_value_heads": tp}
        cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
               "hidden_size": HYBRID_HIDDEN, "intermediate_size": 256,
               "layer_types": ["linear_attention" if k == "mamba" else "full_attention"
                               for k in layers],
               "full_attention_interval": 4,
               "num_attention_heads": max(kv, tp), "num_key_value_heads": kv,
               "head_dim": ATTENTION_HEAD_DIM, **gdn,
               # vLLM's Qwen3-Next needs a sparse layer. Every expert is chosen for
               # every token: a top-k choice flips with the last bit of a float, and
               # a flipped expert moved the output by tenths of a nat between two
               # right computations, hiding wrong hits.
               "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
               "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "norm_topk_prob": True, "attention_bias": False,
               "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
               "torch_dtype": "bfloat16", **common}
        return cfg, "bfloat16"
    kv = _null_kv_heads(tp)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": max(2, kv), "num_key_value_heads": kv, "head_dim": 32,
           "rms_norm_eps": 1e-5,
           "torch_dtype": "float32", **common}
    if "sliding_window" in layers:
        cfg["layer_types"] = ["sliding_attention" if k == "sliding_window" else
                              "full_attention" for k in layers]
        cfg["sliding_window"] = next(g.sliding_window for g in engine.kv_groups
                                     if g.kind == "sliding_window")
    return cfg, "float32"


def draft_config(target: dict[str, Any]) -> dict[str, Any]:
    """A one-layer EAGLE head (Llama) as wide as the target, its attention shaped
    as the target's so that its layer joins the target's attention group (an MLA
    target's: :func:`kimi_linear.draft_config`)."""
    if target["architectures"] == [kimi_linear.TARGET_ARCH]:
        return kimi_linear.draft_config(target)
    return {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama",
            "hidden_size": target["hidden_size"], "intermediate_size": 128,
            "num_attention_heads": target["num_attention_heads"],
            "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": target["head_dim"], "num_hidden_layers": 1,
            "vocab_size": target["vocab_size"],
            "max_position_embeddings": target["max_position_embeddings"],
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "torch_dtype": target["torch_dtype"], "tie_word_embeddings": False}


def _write_once(root: Path, config: dict[str, Any], name: str | None = None) -> Path:
    """``config`` in ``root/<digest>/config.json`` (``root/<digest>/<name>/`` when
    named), written atomically once."""
    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    path = root / hashlib.sha256((text + (name or "")).encode()).hexdigest()[:16]
    model = path / name if name else path
    if (model / "config.json").exists():
        return model
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    inside = tmp / name if name else tmp
    inside.mkdir(exist_ok=True)
    (inside / "config.json").write_text(text)
    try:
        os.rename(tmp, path)
    except OSError:                          # another process wrote the same one first
        shutil.rmtree(tmp)
    return model


def worker_models(engine: EngineBlock, label: str, root: Path) -> WorkerModels:
    """The model directories for ``engine`` under ``root`` (a geometry :func:`refusal`
    refuses never gets here: ``engines.check_supported`` refused it before vLLM loaded).

    The target's directory has the null executor's model's name: the
    MooncakeStore connector names every key by it (``<model>@tp_rank:0@...``),
    so both workers write the same keys."""
    from replayer.replay.engines.config.engine_config import TARGET_MODEL, WIDE_TARGET_MODEL

    target, dtype = target_config(engine)
    spec = engine.speculative
    if drafts.draft_in_target(engine):
        target = drafts.with_mtp(target, spec.mtp_modules, label)    # the draft: its MTP layers
    name = (WIDE_TARGET_MODEL if engine.tensor_parallel_size > 2 else TARGET_MODEL).name
    if engine.model == "kimi-k3":
        name = "kimi-k3"                     # the null executor's (engine_config.KIMI_K3_MODEL)
    path = _write_once(root, target, name)
    draft = None
    if drafts.draft_in_target(engine):
        draft = path
    elif spec is not None and spec.method == "dflash":
        draft = _write_once(root, drafts.dflash_config(target, spec.num_speculative_tokens))
    elif spec is not None and target["architectures"] == [mimo_v2.ARCHITECTURE]:
        draft = _write_once(root, mimo_v2.draft_config(target, engine))
    elif spec is not None:
        draft = _write_once(root, draft_config(target))
    return WorkerModels(path, draft, dtype, target["architectures"][0])


def check_groups(engine: EngineBlock, made: list[tuple[str, int]], label: str) -> None:
    """The KV-cache groups vLLM built from the real model, held to the trace's:
    ``made`` is (kind, block size) per group in vLLM's order."""
    wanted = [(g.kind, g.block_size) for g in engine.kv_groups]
    if made != wanted:
        def show(groups):
            return ", ".join(f"{k}/{b}" for k, b in groups)
        raise _refuse(label, f"vLLM made the KV-cache groups [{show(made)}] from the tiny "
                             f"model, the trace has [{show(wanted)}]")


def check_checkpoints(engine: EngineBlock, made: list[int | None], label: str) -> None:
    """The prefill checkpoints of the Mamba groups vLLM built (each one's
    ``prefill_checkpoint_alignment``, None where it exports none), held to the
    trace's ``mamba_prefill_checkpoint_alignment``: they decide where the
    scheduler ends a prefill chunk, so a model whose layers export other ones
    would not schedule as the null executor does. Kimi's KDA layers are held
    by their own ``engine.kda_prefill_backend`` (their alignment is vLLM's per release)."""
    if engine.kda_prefill_backend is not None:
        return
    wanted = engine.mamba_prefill_checkpoint_alignment
    if any(m != wanted for m in made):
        raise _refuse(label, f"the tiny model's Mamba layers export prefill checkpoints at "
                             f"alignment {made[0]} (vLLM's MambaSpec), the trace's "
                             f"engine.mamba_prefill_checkpoint_alignment is {wanted}")
