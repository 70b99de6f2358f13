"""Benchmark: where a model-worker replay's seconds go (cProfile in the engine process).

Runs one fixture (default: the #51295 case) on the model worker of an
environment's vLLM (default ``.venv-serve``), in that environment's own
interpreter, as a cold engine process would: the imports, the engine's build
(the tiny model's load and the KV cache included), and the replay loop, each
timed; then the replay under cProfile, its seconds by where they were spent
(the Triton interpreter running vLLM's Mamba-copy kernels, torch's compiled
ops, vLLM's Python) and the functions that took the most.

    python benchmarks/model_worker_profile.py [--engine .venv-serve] [--top N] [FIXTURE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "fixtures" / "scenarios" / "vllm51295_turn1_24577.yaml"

# Where a function's own time is counted, by its file (first match wins).
PLACES = [
    ("Python's garbage collector (vLLM's gc.collect calls)", ("<built-in method gc.",)),
    ("Triton's interpreter (Mamba-copy kernels)", ("triton/runtime/interpreter", "triton/language",
                                                   "triton/runtime/jit", "inspect.py")),
    ("torch ops (C++), vLLM's CPU kernels", ("<built-in method torch", "of 'torch._C",
                                             "torch/_ops", "_custom_ops")),
    ("vLLM model code (tiny model, attention, GDN)", ("model_executor/",
                                                      "attention/", "v1/attention")),
    ("vLLM runner and worker", ("v1/worker/", "v1/spec_decode/", "v1/sample/")),
    ("vLLM scheduler and KV-cache manager", ("v1/core/", "v1/engine/", "v1/request")),
    ("the replay (loop, driver, seams)", ("/replayer/",)),
    ("torch Python", ("torch/",)),
]


def outer(args: argparse.Namespace) -> int:
    from replayer.replay.engines.sources.specs import parse_spec, resolve
    from replayer.replay.execution.environment import engine_env, engine_env_defaults

    engine = resolve(parse_spec(args.engine, "model"))
    env = engine_env(engine, ROOT, engine_env_defaults())
    cmd = [engine.interpreter or sys.executable, __file__, "--inner", "--top", str(args.top),
           str(args.fixture), *(["--save", str(args.save.resolve())] if args.save else [])]
    return subprocess.call(cmd, env=env)


def inner(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    from replayer.replay.execution.environment import quiet_vllm

    quiet_vllm(False)
    import vllm  # noqa: F401
    import torch

    from replayer.replay.engines.sources.specs import parse_spec, resolve
    from replayer.replay.execution.in_process import replay_here
    from replayer.replay.engines.worker import executor  # noqa: F401
    from traces import load_target

    imported = time.perf_counter() - start
    trace = load_target(args.fixture)
    spec = resolve(parse_spec("installed", "model"))
    # One replay unprofiled (the figures a user sees), then one under cProfile.
    result = replay_here(trace, spec)
    plain = result.timings
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    again = replay_here(trace, spec)
    prof.disable()
    print(f"{args.fixture.relative_to(ROOT) if args.fixture.is_relative_to(ROOT) else args.fixture}"
          f": {sum(r.num_prompt_tokens for r in result.requests)} prompt tokens, "
          f"{result.steps} steps, torch threads {torch.get_num_threads()}")
    print(f"imports (vLLM, torch, the replayer): {imported:6.1f} s")
    print(f"engine build (model load, KV cache):  {plain['startup_s']:6.1f} s")
    print(f"replay loop:                          {plain['wall_s'] - plain['startup_s']:6.1f} s")
    print(f"under cProfile: build {again.timings['startup_s']:.1f} s, loop "
          f"{again.timings['wall_s'] - again.timings['startup_s']:.1f} s")
    stats = pstats.Stats(prof)
    if args.save:
        stats.dump_stats(args.save)
    own: dict[str, float] = {}
    total = 0.0
    for (filename, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        where = f"{filename}:{name}" if filename != "~" else name
        total += tt
        place = next((p for p, keys in PLACES if any(k in where for k in keys)), "other")
        own[place] = own.get(place, 0.0) + tt
    print(f"\nprofiled seconds by place (own time, {total:.1f} s in all):")
    for place, seconds in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds:7.1f} s  {100 * seconds / total:5.1f}%  {place}")
    print(f"\nthe {args.top} functions with the most own time:")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixture", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--save", type=Path, help="write the profile here (pstats)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.fixture = args.fixture.resolve()
    return inner(args) if args.inner else outer(args)


if __name__ == "__main__":
    sys.exit(main())
