"""Benchmark: the smallest corruption of a hit that ``check --recompute`` names.

For each model the fixtures run on the model worker (the tiny Llama, fp32; the
Qwen3-Next hybrid, bf16 attention beside a float32 gated-DeltaNet state), a
small scenario with one local hit is checked with ``--recompute`` while
``tests/faults/noise_on_resume.py`` adds seeded relative noise
(``x + scale * rms(x) * z``) to one block the hit resumes through: the
attention KV block holding the hit's last cached token (``kv``), or,
separately, the Mamba state block it resumes from (``mamba``). Scales 1e-4,
1e-3, 1e-2, 1e-1, smallest first; a target stops at the first scale named
(a larger one moves the same block further) unless ``--all``. Every hit count
stays the goldens' (the check's first line must say PASS). Prints one line per
run and a table of the smallest scale named per model and target.

    python benchmarks/detection_limit.py [--engine .venv-serve] [--all] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANT = ROOT / "tests" / "faults" / "noise_on_resume.py"
SCALES = (1e-4, 1e-3, 1e-2, 1e-1)

# One writer, then one request resuming from its prefix with 64 new tokens.
LLAMA = """
description: detection limit, tiny Llama (fp32), one local hit at the writer's end
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 1024
  max_num_seqs: 4
  num_gpu_blocks: 96
requests:
  - {id: writer, prompt: [{stream: doc, len: 1024}], output_len: 4}
  - {id: hit, after: writer, prompt: [{stream: doc, len: 1024}, {stream: tail, len: 64}], output_len: 4}
expect:
  writer: {num_cached_tokens: 0}
  hit: {num_cached_tokens: 1024}
"""
HYBRID = """
description: detection limit, Qwen3-Next hybrid (bf16 attention, float32 GDN state), one local hit
engine:
  block_size: 256
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  max_num_batched_tokens: 1024
  max_num_seqs: 4
  num_gpu_blocks: 32
requests:
  - {id: writer, prompt: [{stream: doc, len: 1024}], output_len: 4}
  - {id: hit, after: writer, prompt: [{stream: doc, len: 1024}, {stream: tail, len: 64}], output_len: 4}
expect:
  writer: {num_cached_tokens: 0}
  hit: {num_cached_tokens: 768}
"""
# (model, scenario, what is corrupted)
RUNS = [("tiny-llama fp32", LLAMA, "kv"),
        ("qwen3-next hybrid", HYBRID, "kv"),
        ("qwen3-next hybrid", HYBRID, "mamba")]


def check(engine: str, scenario: Path, target: str, scale: float, seed: int,
          out: Path) -> tuple[bool, dict, float]:
    """One ``check --recompute`` under the plant: (named, the hit's verdict, seconds)."""
    env = {**os.environ, "PREFIX_REPLAYER_NO_SERVER": "1", "PREFIX_REPLAYER_PLANT": str(PLANT),
           "PREFIX_REPLAYER_NOISE_TARGET": target, "PREFIX_REPLAYER_NOISE_SCALE": repr(scale),
           "PREFIX_REPLAYER_NOISE_SEED": str(seed)}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "replayer", "check", str(scenario), "--engine",
                           engine, "--worker", "model", "--recompute", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode not in (0, 1) or not proc.stdout.startswith("PASS "):
        raise SystemExit(f"detection_limit: {scenario.name} {target} {scale:g}: the check did "
                         f"not run cleanly (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    verdict = json.loads(out.read_text())[str(scenario)]["hits"][0]
    return verdict["verdict"] == "wrong hit", verdict, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    ap.add_argument("--all", action="store_true", help="every scale, not only up to the first named")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPU(s), "
          f"engine {args.engine}, seed {args.seed}")
    smallest: dict[tuple[str, str], float | None] = {}
    total = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for model, text, target in RUNS:
            scenario = Path(tmp) / f"{model.split()[0]}.yaml"
            scenario.write_text(text)
            smallest[(model, target)] = None
            for scale in SCALES:
                named, v, seconds = check(args.engine, scenario, target, scale, args.seed,
                                          Path(tmp) / "out.json")
                print(f"  {model:18s} {target:5s} {scale:7.0e}  {'NAMED' if named else 'missed':6s} "
                      f"divergence {v['divergence']:.3g} (threshold {v.get('threshold', 0):.3g}, "
                      f"{v.get('contract', '')[:24]})  {seconds:5.1f} s", flush=True)
                if named and smallest[(model, target)] is None:
                    smallest[(model, target)] = scale
                    if not args.all:
                        break
    print(f"\n| model | corrupted | smallest relative noise named |\n|---|---|---|")
    for (model, target), scale in smallest.items():
        print(f"| {model} | {'one KV block' if target == 'kv' else 'one Mamba state'} | "
              f"{'none up to 1e-1' if scale is None else f'{scale:.0e}'} |")
    print(f"\ntotal {time.perf_counter() - total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
