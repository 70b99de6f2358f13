"""Record a real model served by ``vllm serve`` on a GPU, then replay it on CPU.

Cannot run in CI (needs a GPU and a model). On a GPU machine with this repo
installed beside vLLM 0.33:

    python tools/record_gpu.py --model Qwen/Qwen3-0.6B --out /tmp/rec-gpu
    python tools/record_gpu.py --model MODEL --out DIR --mooncake mooncake.json

It starts ``vllm serve`` with the recording scheduler (and, with
``--mooncake``, the recording MooncakeStore connector), sends a short stream
of shared-prefix requests as token ids (a system prompt, then growing
conversations, then resends), stops the server with SIGINT so the recorder
flushes, and runs ``replayer check --against recorded DIR`` on this machine's
CPU: the replay must reproduce the recorded hits, schedule and store keys.

Async scheduling is turned off (``--no-async-scheduling``): the CPU replay
steps synchronously, so a recording made with async scheduling replays the
same hits but may not match step for step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serve_command(args) -> list[str]:
    cmd = ["vllm", "serve", args.model, "--port", str(args.port),
           "--enable-prefix-caching", "--no-async-scheduling",
           "--scheduler-cls", "replayer.recorder.scheduler.RecordingScheduler",
           "--max-model-len", str(args.max_model_len), "--seed", "0",
           # Without it SIGINT kills the engine process at once (timeout 0 =
           # abort) and the recorder's last unflushed rows are lost.
           "--shutdown-timeout", "60"]
    if args.mooncake:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MooncakeStoreConnector",
            "kv_connector_module_path": "replayer.recorder.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"recorder_dir": str(args.out)}})]
    return cmd + list(args.serve_arg or [])


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vllm serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    sys.exit(f"vllm serve not ready after {timeout:.0f} s")


def requests_stream(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """A system prompt shared by all, conversations that grow turn by turn, resends."""
    rnd = random.Random(seed)
    tok = lambda k: [rnd.randrange(100, vocab) for _ in range(k)]  # noqa: E731
    system = tok(1000)
    convs = [system + tok(rnd.randrange(50, 400)) for _ in range(max(1, n // 4))]
    out = []
    while len(out) < n:
        i = rnd.randrange(len(convs))
        convs[i] = convs[i] + tok(rnd.randrange(20, 200))
        out.append(list(convs[i]))
        if rnd.random() < 0.2:
            out.append(list(convs[i]))              # a resend: a full hit
    return out[:n]


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path, help="new directory for the trace")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=30000, help="token ids drawn below this")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--mooncake", metavar="MOONCAKE.json",
                    help="record the MooncakeStore connector too (MOONCAKE_CONFIG_PATH)")
    ap.add_argument("--serve-arg", action="append", help="extra argument for vllm serve")
    ap.add_argument("--ready-timeout", type=float, default=900)
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} exists and is not empty: record into a new directory")
    env = {**os.environ, "PREFIX_REPLAYER_RECORD_DIR": str(args.out), "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.mooncake:
        env["MOONCAKE_CONFIG_PATH"] = str(Path(args.mooncake).resolve())
    cmd = serve_command(args)
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, env=env)
    try:
        wait_healthy(args.port, server, args.ready_timeout)
        stream = requests_stream(args.requests, args.vocab)
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda p: complete(args.port, args.model, p, args.max_tokens), stream))
        print(f"served {len(stream)} requests in {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        server.send_signal(signal.SIGINT)          # graceful: the recorder flushes its parts
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    # Replay on CPU, pinned as the CLI always is, and compare with the recording.
    check = subprocess.run([sys.executable, "-m", "replayer", "check", "--against", "recorded",
                            str(args.out)], cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return check.returncode


if __name__ == "__main__":
    sys.exit(main())
