"""The served configurations: a tiny model config directory plus serve flags.

Weights are random (``--load-format dummy``) and prompts are token ids
(``--skip-tokenizer-init``): no hub, no tokenizer. Each configuration keeps
the KV cache small (``--num-gpu-blocks-override``) so that a stream of a few
hundred requests evicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from replayer import MODELS_DIR

MODELS = MODELS_DIR


@dataclass(frozen=True)
class ServeConfig:
    name: str
    model: Path
    serve_args: tuple[str, ...]
    max_model_len: int
    tokens_per_block: int          # tokens per Mooncake hash id (512 in the source trace)
    max_prompt: int                # longer prompts are cut
    requests: int                  # stream length of the committed fixture
    max_tokens: int = 4            # output tokens per request (ignore_eos: exactly these)
    env: dict[str, str] = field(default_factory=dict)
    doc: str = ""


def _eagle_args() -> tuple[str, ...]:
    spec = {"method": "eagle", "model": str(MODELS / "tiny-eagle"), "num_speculative_tokens": 2}
    return ("--speculative-config", json.dumps(spec, sort_keys=True))


CONFIGS: dict[str, ServeConfig] = {c.name: c for c in (
    ServeConfig("llama", MODELS / "tiny-llama",
                ("--block-size", "32", "--num-gpu-blocks-override", "3000"),
                max_model_len=4096, tokens_per_block=32, max_prompt=4092, requests=250,
                doc="full attention (2 layers), block 32, 3,000 blocks (96,000 tokens): the "
                    "stream's conversations come back after more than that, so some "
                    "evicted, some hit"),
    ServeConfig("eagle", MODELS / "tiny-llama",
                ("--block-size", "32", "--num-gpu-blocks-override", "400") + _eagle_args(),
                max_model_len=4096, tokens_per_block=64, max_prompt=4088, requests=100,
                doc="Llama with an EAGLE draft of 1 layer, 2 speculative tokens; a hash id "
                    "is 2 blocks, so the shared first one survives the EAGLE drop"),
    ServeConfig("qwen3-next", MODELS / "tiny-qwen3-next",
                # --block-size 256 given, not left to vLLM: the CPU platform's
                # default (128) comes back when EngineCoreProc re-runs
                # VllmConfig.__post_init__ after its handshake, after the
                # scheduler was built with the hybrid's 256, and the align-mode
                # split then cuts prefills on 128-token boundaries (896 + 128).
                # --mamba-ssm-cache-dtype bfloat16 given too: left at auto, the
                # CPU platform keeps the model's bf16 on a CPU without AVX-512
                # BF16 but resets it to float32 on one with it (for its GDN
                # kernel), which doubles the Mamba page and aligns attention up
                # to block 512: the same recording gave other hits per machine.
                ("--mamba-cache-mode", "align", "--block-size", "256",
                 "--mamba-ssm-cache-dtype", "bfloat16"),
                max_model_len=2048, tokens_per_block=256, max_prompt=1024, requests=40,
                doc="Qwen3-Next hybrid (3 GDN layers + 1 full attention, MoE), bf16, align "
                    "mode, block 256: every prompt shares its first block"),
)}


def config(name: str) -> ServeConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown configuration {name!r} (known: {', '.join(CONFIGS)})") from None
