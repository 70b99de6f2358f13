"""PLANTED FAULT (tests and benchmarks/detection_limit.py; run in the engine process by
PREFIX_REPLAYER_PLANT).

A seeded, sized corruption of what a hit resumes from, for measuring the
smallest wrong hit ``check --recompute`` names: when a request starts from a
prefix hit, one block it resumes through gets relative noise before its first
step reads it, ``x + scale * rms(x) * z`` with ``z`` standard normal from a
generator seeded by ``PREFIX_REPLAYER_NOISE_SEED`` (0), in the tensor's own
dtype (a bf16 block keeps what bf16 can hold of it). What is corrupted
(``PREFIX_REPLAYER_NOISE_TARGET``):

* ``kv``: the block of the first full-attention group that holds the hit's
  last cached token (keys and values, every layer of the group);
* ``mamba``: the Mamba (linear-attention) state block the hit resumes from
  (its conv and recurrent state, every layer of the group).

``PREFIX_REPLAYER_NOISE_SCALE`` (required) is the relative size. The
scheduler's hit is untouched, so every hit count and golden is unchanged. Local
hits only: a block loaded from a store is written after this runs.
"""

import os

import torch
import vllm.v1.worker.gpu_model_runner as gmr

SPEC = {"kv": "FullAttentionSpec", "mamba": "MambaSpec"}


def _noise(tensor: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    x = tensor.float()
    rms = x.pow(2).mean().sqrt()
    z = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    tensor.copy_((x + scale * rms * z).to(tensor.dtype))


def _blocks_of(cache, block: int):
    """The tensors of one block in a layer's cache (attention: one tensor; Mamba: a
    list of state tensors)."""
    if isinstance(cache, torch.Tensor):
        return [cache[block]]
    return [t[block] for t in cache]


def _corrupt(runner, new, target: str, scale: float, gen: torch.Generator) -> None:
    ctx = runner.compilation_config.static_forward_context
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec).__name__ != SPEC[target]:
            continue
        block = new.block_ids[gid][(new.num_computed_tokens - 1) // spec.block_size]
        for name in group.layer_names:
            for t in _blocks_of(ctx[name].kv_cache, block):
                _noise(t, scale, gen)
        return
    raise RuntimeError(f"noise_on_resume: no {SPEC[target]} group to corrupt")


if not getattr(gmr.GPUModelRunner, "_planted_noise_on_resume", False):
    _real = gmr.GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        target = os.environ.get("PREFIX_REPLAYER_NOISE_TARGET", "kv")
        scale = float(os.environ["PREFIX_REPLAYER_NOISE_SCALE"])
        gen = torch.Generator().manual_seed(int(os.environ.get("PREFIX_REPLAYER_NOISE_SEED", "0")))
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens > 0:
                _corrupt(self, new, target, scale, gen)
        return _real(self, scheduler_output, *args, **kwargs)

    gmr.GPUModelRunner.execute_model = execute_model
    gmr.GPUModelRunner._planted_noise_on_resume = True
