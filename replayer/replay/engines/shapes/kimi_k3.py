"""Kimi-K3's KV-cache geometry as vLLM derives it: block size, page sizes, groups.

The model config is ``replayer/models/kimi-k3/config.json``: Kimi-K3's text
model as public copies of its ``config.json`` give it (93 layers, KDA at the
1-based layers that are not multiples of 4 nor the last, MLA at 4, 8, ..., 92
and 93; KDA 96 heads of 128, short conv kernel 4, gate lower bound -5; MLA
kv_lora_rank 512, qk_rope_head_dim 64), under vLLM's text-model architecture
for it (``KimiLinearForCausalLM``, which ``KimiK3ForConditionalGeneration``
delegates its Mamba shapes to). Its hidden sizes are tiny: nothing here or in
a replay reads them.

What runs is vLLM's own code, in the order the engine runs it on a GPU:
``Platform._preferred_block_size_for_backends`` (the attention backend's block,
"kv cache block size 32 for FLASHINFER_MLA"), ``Platform._align_hybrid_block_size``
(the attention block stretched, in multiples of 128 for MLA, until its page
covers one KDA state, then the KDA page padded to it), the model's
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``
(the KDA state: its conv rows grow with the speculative tokens), the FlashKDA
checkpoint alignment (``kda_prefill_checkpoint_alignment``), and
``get_kv_cache_groups`` over one spec per layer (vLLM groups the 24 MLA layers,
plus a draft layer, and the 69 KDA layers into groups of equal size).

Run it as ``python -m replayer.replay.engines.shapes.kimi_k3`` to print the
derivation (docs/kimi-k3.md shows it); tests/test_kimi_k3.py checks every
fixture under fixtures/kimi_k3/ against it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from replayer import MODELS_DIR

KIMI_K3_CONFIG = MODELS_DIR / "kimi-k3"
ATTENTION_BACKEND = "FLASHINFER_MLA"      # #50235's log: "kv cache block size 32 for FLASHINFER_MLA"
KDA_PREFILL_BACKEND = "flashkda"          # "auto" on SM90/SM10x (resolve_kda_prefill_backend)


@dataclass(frozen=True)
class KimiK3Geometry:
    """What vLLM makes of Kimi-K3 at one TP size, draft length and KV dtype."""

    tensor_parallel_size: int
    decode_context_parallel_size: int
    num_speculative_tokens: int
    kv_cache_dtype: str
    attention_backend: str
    backend_block_size: int              # phase 1: the backend's preferred block
    mla_bytes_per_token: int             # one MLA layer, one token
    kda_state_shapes: tuple[tuple[int, ...], ...]   # per rank: conv state, recurrent state
    kda_state_dtypes: tuple[str, ...]
    kda_page_bytes: int                  # one KDA layer's state, unpadded
    block_size: int                      # attention and KDA block (align mode)
    page_bytes: int                      # attention page; the KDA page is padded to it
    prefill_checkpoint_alignment: int | None
    groups: tuple[tuple[str, int, int], ...]   # (kind, layers, block span with DCP)

    @property
    def kda_padding_percent(self) -> float:
        return 100 * (self.page_bytes - self.kda_page_bytes) / self.kda_page_bytes

    def kv_groups(self) -> list[dict[str, Any]]:
        """The engine block's ``kv_groups``, in vLLM's group order."""
        return [{"kind": kind, "block_size": self.block_size} for kind, _, _ in self.groups]


def _model_config(model_dtype: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(KIMI_K3_CONFIG), skip_tokenizer_init=True,
                       dtype=model_dtype, max_model_len=1 << 20)


def derive(tensor_parallel_size: int = 8, num_speculative_tokens: int = 0, *,
           decode_context_parallel_size: int = 1, kv_cache_dtype: str = "fp8",
           model_dtype: str = "bfloat16",
           attention_backend: str = ATTENTION_BACKEND) -> KimiK3Geometry:
    """Kimi-K3's geometry by vLLM's own functions (the installed vLLM)."""
    from vllm.model_executor.layers.mamba.kda_checkpoint import (
        kda_prefill_checkpoint_alignment,
    )
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, get_kv_quant_mode

    config, preferred = _resolved_config(tensor_parallel_size, num_speculative_tokens,
                                         decode_context_parallel_size, kv_cache_dtype,
                                         model_dtype, attention_backend)
    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    shapes = tuple(tuple(s) for s in model_cls.get_mamba_state_shape_from_config(config))
    dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(config))
    kda_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    kv_dtype = (model.dtype if kv_cache_dtype == "auto"
                else STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype])
    mla = MLAAttentionSpec(block_size=cache.block_size,
                           num_kv_heads=model.get_num_kv_heads(parallel),
                           head_size=model.get_head_size(), dtype=kv_dtype,
                           cache_dtype_str=kv_cache_dtype,
                           kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    alignment = kda_prefill_checkpoint_alignment(KDA_PREFILL_BACKEND)
    kda = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=cache.mamba_block_size,
                    page_size_padded=cache.mamba_page_size_padded,
                    mamba_cache_mode="align",
                    num_speculative_blocks=num_speculative_tokens,
                    num_prefill_checkpoint_blocks=int(alignment is not None),
                    prefill_checkpoint_alignment=alignment)
    groups = _groups(config, model, mla, kda, draft=bool(num_speculative_tokens))
    return KimiK3Geometry(
        tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        num_speculative_tokens=num_speculative_tokens, kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend, backend_block_size=preferred,
        mla_bytes_per_token=mla.page_size_bytes // mla.block_size,
        kda_state_shapes=shapes, kda_state_dtypes=tuple(str(d).removeprefix("torch.")
                                                        for d in dtypes),
        kda_page_bytes=kda_page, block_size=cache.block_size,
        page_bytes=mla.page_size_bytes, prefill_checkpoint_alignment=alignment,
        groups=groups)


def _resolved_config(tensor_parallel_size: int, num_speculative_tokens: int,
                     decode_context_parallel_size: int, kv_cache_dtype: str, model_dtype: str,
                     attention_backend: str) -> tuple[Any, int]:
    """The config fields vLLM's geometry functions read, with the block sizes its
    platform resolves for ``attention_backend``; and the backend's preferred block."""
    from vllm.config import CacheConfig, CompilationConfig, ParallelConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = _model_config(model_dtype)
    cache = CacheConfig(cache_dtype=kv_cache_dtype, enable_prefix_caching=True,
                        mamba_cache_mode="align")
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                              decode_context_parallel_size=decode_context_parallel_size)
    speculative = (SimpleNamespace(num_speculative_tokens=num_speculative_tokens)
                   if num_speculative_tokens else None)
    # The fields these functions read; no model is built, so no layer is
    # registered (get_mamba_prefill_checkpoint_alignment then answers 1, and
    # FlashKDA's 16 divides the MLA alignment of 128 either way).
    config = SimpleNamespace(model_config=model, cache_config=cache,
                             parallel_config=parallel, speculative_config=speculative,
                             compilation_config=CompilationConfig(),
                             scheduler_config=SimpleNamespace(
                                 disable_hybrid_kv_cache_manager=False))
    config.with_hf_config = None
    backend = AttentionBackendEnum[attention_backend].get_class()
    with set_current_vllm_config(config):
        preferred = Platform._preferred_block_size_for_backends(
            [backend], CacheConfig.DEFAULT_BLOCK_SIZE, config)
    cache.block_size = preferred
    Platform._align_hybrid_block_size(config, backend)
    return config, preferred


def _groups(config: Any, model: Any, mla: Any, kda: Any,
            draft: bool) -> tuple[tuple[str, int, int], ...]:
    """vLLM's grouping of one spec per layer (``get_kv_cache_groups``); a draft
    model's layer (EAGLE's one, marked ``is_draft``) joins the MLA layers."""
    from dataclasses import replace

    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from replayer.replay.engines.kv_kinds import spec_kind

    linear = model.hf_config.linear_attn_config
    specs: dict[str, Any] = {}
    for i in range(model.hf_config.num_hidden_layers):
        kda_layer = (i + 1) in linear["kda_layers"]
        specs[f"model.layers.{i}.self_attn{'' if kda_layer else '.attn'}"] = (
            kda if kda_layer else mla)
    if draft:
        specs["draft.layers.0.attn"] = replace(mla, is_draft=True)
    dcp = config.parallel_config.decode_context_parallel_size
    # The layout the engine core resolves before grouping (the replay's null
    # workers report NHD); pages are equal here, so it decides nothing.
    config.cache_config.kv_cache_layout = "NHD"
    out = []
    for group in get_kv_cache_groups(config, specs):
        spec = group.kv_cache_spec
        out.append((spec_kind(spec), len(group.layer_names), resolve_dcp_kv_block_size(spec, dcp)))
    return tuple(out)


def describe(g: KimiK3Geometry) -> list[str]:
    """The derivation, one step a line."""
    conv, recurrent = g.kda_state_shapes
    conv_dtype, state_dtype = g.kda_state_dtypes
    counts: dict[str, int] = {}
    for kind, _, _ in g.groups:
        counts[kind] = counts.get(kind, 0) + 1
    spans = ", ".join(f"{kind} {layers} layers span {span}" for kind, layers, span in g.groups)
    return [
        f"Kimi-K3 at TP {g.tensor_parallel_size}, DCP {g.decode_context_parallel_size}, "
        f"{g.num_speculative_tokens} speculative tokens, KV {g.kv_cache_dtype}, "
        f"{g.attention_backend}:",
        f"  backend block             {g.backend_block_size}",
        f"  MLA page per token        {g.mla_bytes_per_token} bytes",
        f"  KDA state per rank        conv {list(conv)} {conv_dtype} + recurrent "
        f"{list(recurrent)} {state_dtype} = {g.kda_page_bytes} bytes",
        f"  block (attention and KDA) {g.block_size} tokens: the first multiple of 128 "
        f"(MLA's kernel alignment) whose page holds one KDA state",
        f"  page                      {g.block_size} x {g.mla_bytes_per_token} = "
        f"{g.page_bytes} bytes (the KDA state padded {g.kda_padding_percent:.2f}%)",
        f"  FlashKDA checkpoints      alignment {g.prefill_checkpoint_alignment}",
        f"  groups                    {counts.get('mla', 0)} MLA + {counts.get('mamba', 0)} "
        f"KDA: {spans}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replayer.replay.engines.shapes.kimi_k3",
        description="Kimi-K3's KV-cache geometry as the installed vLLM derives it")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--speculative-tokens", type=int, nargs="+", default=[0])
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    args = parser.parse_args(argv)
    # vLLM's own log lines (padding layers, block sizes) are what this prints, in steps.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for n in args.speculative_tokens:
        g = derive(args.tp, n, decode_context_parallel_size=args.dcp,
                   kv_cache_dtype=args.kv_cache_dtype)
        if args.json:
            print(json.dumps({**g.__dict__, "kv_groups": g.kv_groups()}, default=list))
        else:
            print("\n".join(describe(g)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
