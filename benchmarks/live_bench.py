"""One round of vLLM's own benchmark client against a live server here.

Shared by the live benchmarks (``record_overhead_live.py``, ``record_soak.py``):
``vllm bench serve`` from ``.venv-serve`` with the prefix-repetition dataset, its
result saved as JSON. ``args`` carries the dataset's sizes (``prefix_len``,
``suffix_len``, ``prefixes``, ``output_len``, ``prompts``, ``concurrency``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from replayer.recorder.live.server import SERVE_VENV, SERVED_NAME, Server


def bench(server: Server, tokenizer: Path, args: Any, result: Path, seed: int = 0) -> dict:
    """One `vllm bench serve` round; its saved result (a failed round exits)."""
    cmd = [str(SERVE_VENV / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{server.port}", "--model", SERVED_NAME,
           "--tokenizer", str(tokenizer), "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(args.prefixes),
           "--prefix-repetition-output-len", str(args.output_len),
           "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
           "--seed", str(seed), "--ignore-eos", "--ready-check-timeout-sec", "0",
           "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    return json.loads(result.read_text())
