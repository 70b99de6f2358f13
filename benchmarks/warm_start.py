"""Benchmark: what the warm server saves, cold against warm, and explain in parallel.

Prints, each the median of ``--repeat`` runs (min-max beside it) with its
target and whether it is met:

* ``replayer check`` of the #51295 fixture, wall from the client's start to
  its exit: cold (``PREFIX_REPLAYER_NO_SERVER=1``: vLLM imported by the
  command) and warm (a fork of the server's engine); target warm <= 1.0 s;
* ``pytest fixtures/`` through the plugin, on the installed vLLM and on
  vllm==0.29.0, cold and warm; target warm <= 60 s for both engines;
* ``explain`` of ``fixtures/traces/conversation_500`` on the warm server, its
  replays one after the other (serial) and all at once (parallel, as
  ``replayer explain`` runs them), with whether both explanations are
  byte-identical; target parallel <= 0.6x serial on 2 cores.

The server runs in a private runtime directory of the benchmark's own and is
stopped at the end; its engines are warmed before anything is timed.

    python benchmarks/warm_start.py             # median of 5 (~15 min on 2 cores)
    python benchmarks/warm_start.py --quick     # one run each
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "fixtures/scenarios/vllm51295_turn1_24577.yaml"
CONVERSATION = ROOT / "fixtures" / "traces" / "conversation_500"


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return took


def median_line(name: str, times: list[float], target: str = "",
                met: bool | None = None) -> str:
    med = statistics.median(times)
    spread = f"{min(times):.2f}-{max(times):.2f}" if len(times) > 1 else "-"
    verdict = "" if met is None else ("met" if met else "NOT met")
    return f"{name:<44} {med:>8.2f} s  ({spread:>13})  {target:<18} {verdict}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one run of each")
    args = ap.parse_args()
    repeat = 1 if args.quick else args.repeat
    runtime = Path(tempfile.mkdtemp(prefix="rp-bench-", dir="/tmp"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("_PREFIX_REPLAYER")}
    warm = {**base, "PREFIX_REPLAYER_RUNTIME_DIR": str(runtime), "PREFIX_REPLAYER_NO_SERVER": ""}
    cold = {**base, "PREFIX_REPLAYER_NO_SERVER": "1"}
    py = sys.executable
    replayer = [py, "-m", "replayer"]
    lines = []
    try:
        t = timed([*replayer, "server", "start", "--engine", "installed",
                   "--engine", "vllm==0.29.0"], warm)
        print(f"server started, two engines warm, in {t:.1f} s", flush=True)
        check = [*replayer, "check", FIXTURE]
        cold_check, warm_check = [], []
        for _ in range(repeat):                     # interleaved: the machine's load alike
            cold_check.append(timed(check, cold))
            warm_check.append(timed(check, warm))
        lines.append(median_line("check #51295 fixture, cold", cold_check))
        w = statistics.median(warm_check)
        lines.append(median_line("check #51295 fixture, warm", warm_check, "<= 1.0 s", w <= 1.0))
        for engine in ("installed", "vllm==0.29.0"):
            cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "fixtures/",
                   "--replayer-engine", engine]
            c_times, w_times = [], []
            for _ in range(repeat):
                c_times.append(timed(cmd, cold))
                w_times.append(timed(cmd, warm))
            lines.append(median_line(f"pytest fixtures/ on {engine}, cold", c_times))
            w = statistics.median(w_times)
            lines.append(median_line(f"pytest fixtures/ on {engine}, warm", w_times,
                                     "<= 60 s", w <= 60))
        lines.extend(explain_figures(runtime, repeat))
    finally:
        subprocess.run([*replayer, "server", "stop"], env=warm, capture_output=True)
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"\n{'figure':<44} {'median':>10}  {'(min-max)':>15}  {'target':<18}")
    print("\n".join(lines))
    print(f"\n{repeat} run(s) each on {os.cpu_count()} core(s)")
    return 0


def explain_figures(runtime: Path, repeat: int) -> list[str]:
    """Serial and parallel explain on the warm server, in this process's client."""
    os.environ["PREFIX_REPLAYER_RUNTIME_DIR"] = str(runtime)
    os.environ.pop("PREFIX_REPLAYER_NO_SERVER", None)
    sys.path.insert(0, str(ROOT))
    from traces import load_target

    from replayer.replay.execution.clients import make_client
    from replayer.replay.execution.environment import engine_env_defaults
    from replayer.analysis.explain import explain

    trace = load_target(CONVERSATION)
    client = make_client("installed", own_process=True, env_defaults=engine_env_defaults())
    serial, parallel, same = [], [], True
    for _ in range(repeat):
        start = time.perf_counter()
        a = explain(trace, run=client)
        serial.append(time.perf_counter() - start)
        start = time.perf_counter()
        b = explain(trace, run=client, run_many=client.replay_many)
        parallel.append(time.perf_counter() - start)
        same = same and a.dumps() == b.dumps()
    ratio = statistics.median(parallel) / statistics.median(serial)
    client.close()
    return [median_line("explain conversation_500, serial (warm)", serial),
            median_line("explain conversation_500, parallel (warm)", parallel,
                        "<= 0.6x serial", ratio <= 0.6),
            f"{'  parallel / serial':<44} {ratio:>8.2f}x  identical: {'yes' if same else 'NO'}"]


if __name__ == "__main__":
    sys.exit(main())
