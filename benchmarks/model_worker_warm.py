"""Benchmark: a model-worker replay cold, and warm on the server; ``check --recompute`` beside it.

For one fixture (default: the #51295 case) on an environment's vLLM (default
``.venv-serve``), each a whole command as a user runs it (``.venv/bin/replayer``,
wall seconds, interpreter start included; ``python -m replayer`` in this checkout):

* ``run --worker model --no-server``: cold (an engine process of its own);
* ``server start --engine E --worker model`` (a server of its own, in a
  private runtime directory), then the same ``run`` warm, ``--repeat`` times;
  the warm ``--json`` held to the cold one, byte for byte;
* ``check --recompute`` warm, and its ratio to the plain warm ``run``; with
  ``--cold-recompute`` also cold, and its ratio to the plain cold ``run``.

    python benchmarks/model_worker_warm.py [--engine .venv-serve] [--repeat 2] [--cold-recompute] [FIXTURE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "fixtures" / "scenarios" / "vllm51295_turn1_24577.yaml"
# `python -m replayer` in this checkout (not the venv's console script): a copy of
# the checkout elsewhere benchmarks its own sources.
REPLAYER = [str(ROOT / ".venv" / "bin" / "python"), "-m", "replayer"]


def timed(args: list[str], env: dict[str, str], expect: tuple[int, ...] = (0,)) -> float:
    start = time.perf_counter()
    proc = subprocess.run([*REPLAYER, *args], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode not in expect:
        sys.exit(f"replayer {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixture", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold-recompute", action="store_true")
    args = ap.parse_args()
    fixture = str(args.fixture)
    model = ["--engine", args.engine, "--worker", "model"]
    with tempfile.TemporaryDirectory(prefix="model-worker-warm-") as tmp:
        env = {**os.environ, "PREFIX_REPLAYER_RUNTIME_DIR": f"{tmp}/run",
               "PREFIX_REPLAYER_AUTO_SERVER": "0"}
        env.pop("PREFIX_REPLAYER_NO_SERVER", None)
        rows: list[tuple[str, float]] = []
        cold = timed(["run", fixture, *model, "--no-server", "--no-progress",
                      "--json", f"{tmp}/cold.json"], env)
        rows.append(("run, cold", cold))
        if args.cold_recompute:
            rows.append(("check --recompute, cold", timed(
                ["check", fixture, *model, "--no-server", "--no-progress", "--recompute"], env,
                (0, 1))))
        rows.append(("server start --worker model", timed(["server", "start", *model], env)))
        try:
            warm = []
            for i in range(args.repeat):
                warm.append(timed(["run", fixture, *model, "--no-progress",
                                   "--json", f"{tmp}/warm{i}.json"], env))
                rows.append((f"run, warm ({i + 1})", warm[-1]))
            recompute = timed(["check", fixture, *model, "--no-progress", "--recompute"], env,
                              (0, 1))
            rows.append(("check --recompute, warm", recompute))
        finally:
            timed(["server", "stop"], env)
        same = all(Path(f"{tmp}/warm{i}.json").read_bytes() == Path(f"{tmp}/cold.json")
                   .read_bytes() for i in range(args.repeat))
    print(f"{fixture} on {args.engine}, --worker model (wall seconds, whole commands; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)")
    for what, seconds in rows:
        print(f"  {what:32s} {seconds:7.1f}")
    best = min(warm)
    print(f"  warm --json identical to cold: {'yes' if same else 'NO'}")
    print(f"  check --recompute / run, warm: {recompute / best:.2f}")
    if args.cold_recompute:
        print(f"  check --recompute / run, cold: {dict(rows)['check --recompute, cold'] / cold:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
