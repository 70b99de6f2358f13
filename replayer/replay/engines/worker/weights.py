"""The weights seam: seeded random weights at a scale where the context moves the output.

vLLM's dummy loader draws every weight from about +-1e-3: a tiny model then
answers the same distribution whatever its context (two 1,000-token prompts
sharing only their last token gave logprobs equal to seven decimals), so a
wrong KV block or Mamba state could never show. This loader is vLLM's dummy
loader with one change, the values: each parameter is drawn from a generator
seeded by its name (the same bytes in every process and run), matrices
N(0, 1/fan_in) (the LM head x4, so that logprobs spread over a range of tens
of nats), embeddings N(0, 1), norms at their identity, biases 0, and the
gated-DeltaNet's decay slow enough that its state carries thousands of tokens
(:func:`_value`'s ``A_log``). At this
scale attention stays broad: changing the first of 1,000 prompt tokens moved
the Llama model's output logprobs by 1.2e-2 where the same prompt twice moved
them by at most 8e-6 (2026-12-03); tripling the attention's QKV (sharper
attention) hid that token (1.9e-6).

It is registered with vLLM's ``register_model_loader`` (its extension point
for load formats) and chosen by ``LoadConfig(load_format=LOAD_FORMAT)``; the
draft model is loaded by the same loader. Everything after loading
(``process_weights_after_loading``, the CPU's weight packing) is vLLM's own.
"""

from __future__ import annotations

import hashlib
import math

import torch

LOAD_FORMAT = "replayer_seeded"
SEED = "prefix-replayer weights v1"
QKV_SCALE = 1.0
LM_HEAD_SCALE = 4.0


def _generator(name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _value(name: str, shape: torch.Size, gemma_norm: bool, plain_norm: bool) -> torch.Tensor:
    """The fp32 value of parameter ``name``: a pure function of its name and shape."""
    g = _generator(name)
    leaf = name.rsplit(".", 1)[-1]
    if gemma_norm:                                # x * (1 + w): identity at 0
        return torch.zeros(shape)
    if plain_norm:
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    if leaf == "A_log":
        # Slow decay: per token the state keeps exp(-A * softplus(a + dt_bias)),
        # about 1 - A; with A in [1e-4, 1e-3] it remembers thousands of tokens,
        # so the state a hit resumes from still shapes the output (with the
        # initialiser's A in [1, 16] it is forgotten within a few tokens, and a
        # wrong state could never show).
        return torch.log(torch.empty(shape).uniform_(1e-4, 1e-3, generator=g))
    if leaf == "A":
        # Mamba2's A as vLLM holds it after loading (-exp(A_log)): the same slow
        # decay; the plain ones below would grow the state each token.
        return -torch.empty(shape).uniform_(1e-4, 1e-3, generator=g)
    if leaf == "dt_bias":
        return torch.zeros(shape)
    if len(shape) < 2:
        return torch.ones(shape)
    x = torch.randn(shape, generator=g)
    if "embed_tokens" in name:
        return x
    fan_in = shape[-1]
    scale = 1.0 / math.sqrt(fan_in)
    if "qkv_proj" in name:
        scale *= QKV_SCALE
    elif "lm_head" in name:
        scale *= LM_HEAD_SCALE
    return x * scale


def fill(model: torch.nn.Module) -> int:
    """Overwrite every parameter of ``model`` in place; returns how many."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    n = 0
    for module_name, module in model.named_modules():
        gemma = isinstance(module, GemmaRMSNorm)
        norm = not gemma and "norm" in type(module).__name__.lower()
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            value = _value(name, param.shape, gemma and leaf == "weight",
                           norm and leaf == "weight")
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))
            n += 1
    return n


# Tests only: vLLM's own dummy loader instead, to show it cannot tell contexts apart.
DUMMY_ENV = "PREFIX_REPLAYER_DUMMY_WEIGHTS"


def register() -> str:
    """Register the loader with vLLM (once per process); returns its load format
    (vLLM's ``dummy`` where the environment says ``PREFIX_REPLAYER_DUMMY_WEIGHTS=1``)."""
    import os

    if os.environ.get(DUMMY_ENV) == "1":
        return "dummy"
    from vllm.model_executor.model_loader import get_model_loader, register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    try:
        from vllm.config.load import LoadConfig

        get_model_loader(LoadConfig(load_format=LOAD_FORMAT))
        return LOAD_FORMAT
    except Exception:  # noqa: BLE001 - not registered yet
        pass

    @register_model_loader(LOAD_FORMAT)
    class SeededWeightsLoader(DummyModelLoader):
        """vLLM's dummy loader with the replay's seeded values (module docstring)."""

        def load_weights(self, model, model_config) -> None:  # noqa: ANN001
            from replayer.replay.engines.worker.architectures.drafts import finish_load

            fill(model)
            finish_load(model)          # what the model's load_weights does after

    return LOAD_FORMAT
