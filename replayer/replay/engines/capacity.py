"""The fewest KV-cache blocks vLLM builds an engine with, in vLLM's own terms.

vLLM refuses a pool (``num_gpu_blocks_override``) that cannot hold one request
of ``max_model_len``: in ``get_kv_cache_configs`` (0.29-0.33) each KV-cache
group claims its own blocks of the shared pool, as many as its spec's
``max_memory_usage_bytes`` (or ``max_memory_usage_pages``) over its page
size, and the block pool holds one null block back. The sum plus one is the
floor; it is asked of vLLM's specs on a built scheduler, never derived from
the trace's geometry (a Mamba group's blocks per request, a sliding window's
span, the EAGLE draft layer all count as vLLM counts them). ``replayer
shrink`` searches ``num_gpu_blocks`` no lower.
"""

from __future__ import annotations

from typing import Any


def min_gpu_blocks(scheduler: Any) -> int:
    """The smallest ``num_gpu_blocks`` vLLM accepts for ``scheduler``'s config."""
    config = scheduler.vllm_config
    total = 0
    for group in scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        pages = getattr(spec, "max_memory_usage_pages", None)   # UniformTypeKVCacheSpecs
        if pages is not None:
            total += int(pages(config))
        else:
            total += -(-int(spec.max_memory_usage_bytes(config)) // int(spec.page_size_bytes))
    return total + 1                        # the null block the block pool holds back
