"""Record a real ``vllm serve`` on this CPU with a real client, then check three-way agreement.

    tools/record_live.py record --config llama --out DIR [--requests N] [--concurrency 4]
    tools/record_live.py store --config llama --out DIR
    tools/record_live.py agree DIR [--engine vllm==0.32.0]

``record`` starts ``vllm serve`` from ``.venv-serve`` (``make serve-venv``)
with the recorder writing to DIR, sends a slice of the Mooncake conversation
trace as token-id prompts with the ``openai`` client, stops the server with
SIGINT and writes DIR/client.parquet (the cached tokens the server reported).
``agree`` compares, per request, the client's cached tokens, the recorder's
outcome and a CPU replay; it exits 1 on any difference. Run both inside a
private network namespace (``unshare -n sh -c 'ip link set lo up && ...'``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replayer.recorder.live.agreement import agree  # noqa: E402
from replayer.recorder.live.client import send_stream, write_client  # noqa: E402
from replayer.recorder.live.configs import CONFIGS, config  # noqa: E402
from replayer.recorder.live.server import LiveError, Server  # noqa: E402
from replayer.recorder.live.store_plan import MASTER_KEYS_FILE, run_plan  # noqa: E402
from replayer.recorder.live.stream import mooncake_stream  # noqa: E402


def new_recording(args) -> tuple[Path, Path] | None:
    """(the trace directory, the server log) for ``--out``/``--log``; None (said on
    stderr) when the directory holds something: each run records into a new one."""
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        print(f"record_live: {out}: exists and is not empty: record into a new directory",
              file=sys.stderr)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, args.log or out.parent / f"{out.name}.serve.log"


def record(args) -> int:
    cfg = config(args.config)
    where = new_recording(args)
    if where is None:
        return 2
    out, log = where
    stream = mooncake_stream(args.requests or cfg.requests, cfg.tokens_per_block,
                             min(cfg.max_prompt, cfg.max_model_len - cfg.max_tokens),
                             cfg.max_tokens, start=args.start, time_scale=args.time_scale)
    server = Server(cfg, out, log, args.port, kv_events=args.kv_events)
    try:
        server.start(args.ready_timeout)
        print(f"{cfg.name}: vllm serve ready in {server.startup_s:.0f} s", flush=True)
        t0 = time.monotonic()
        rows = send_stream(server.base_url, stream, args.concurrency)
        sent_s = time.monotonic() - t0
        rc = server.stop()
    except LiveError as exc:
        print(f"record_live: {exc}", file=sys.stderr)
        return 1
    finally:
        server.kill()
    if rc != 0:
        print(f"record_live: vllm serve exited with {rc} after SIGINT; log {log}", file=sys.stderr)
        return 1
    write_client(out, rows)
    hit = sum(r["cached_tokens"] or 0 for r in rows)
    prompt = sum(r["num_prompt_tokens"] for r in rows)
    print(f"{cfg.name}: {len(rows)} requests in {sent_s:.0f} s (concurrency {args.concurrency}), "
          f"{prompt} prompt tokens, {hit} cached by the server's count; trace in {out}")
    return 0


def store_cmd(args) -> int:
    """vLLM #56615's plan with the MooncakeStore connector and a real master."""
    cfg = config(args.config)
    where = new_recording(args)
    if where is None:
        return 2
    out, log = where
    try:
        rows = run_plan(cfg, out, log, args.port, args.ready_timeout)
    except (LiveError, RuntimeError) as exc:
        print(f"record_live: {exc}", file=sys.stderr)
        return 1
    keys = (out / MASTER_KEYS_FILE).read_text().split()
    print(f"{cfg.name} + MooncakeStore: cached tokens per request "
          f"{[r['cached_tokens'] for r in rows]}, {len(keys)} key(s) on the master; "
          f"trace in {out}")
    return 0


def agree_cmd(args) -> int:
    result = agree(args.trace, args.engine)
    print(result.summary())
    for line in result.lines:
        print("  " + line)
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a live server into a new trace directory")
    rec.add_argument("--config", required=True, choices=sorted(CONFIGS))
    rec.add_argument("--out", required=True, type=Path)
    rec.add_argument("--requests", type=int,
                     help="stream length (default: the configuration's fixture length)")
    rec.add_argument("--start", type=int, default=0, help="first request of the Mooncake slice")
    rec.add_argument("--concurrency", type=int, default=4)
    rec.add_argument("--kv-events", action="store_true",
                     help="turn vLLM's KV-cache events on; the recording gets a kv_events table")
    rec.add_argument("--time-scale", type=float, default=0.5,
                     help="multiplies the trace's arrival times")
    rec.add_argument("--port", type=int, default=8011)
    rec.add_argument("--ready-timeout", type=float, default=600)
    rec.add_argument("--log", type=Path, help="server log (default OUT.serve.log beside OUT)")
    st = sub.add_parser("store", help="record vLLM #56615's plan (3 prompts, reset, again) "
                                      "through the MooncakeStore connector and a real master")
    st.add_argument("--config", required=True, choices=sorted(CONFIGS))
    st.add_argument("--out", required=True, type=Path)
    st.add_argument("--port", type=int, default=8011)
    st.add_argument("--ready-timeout", type=float, default=600)
    st.add_argument("--log", type=Path, help="server log (default OUT.serve.log beside OUT)")
    ag = sub.add_parser("agree", help="client vs recorder vs CPU replay, per request")
    ag.add_argument("trace", type=Path)
    ag.add_argument("--engine", default="vllm==0.32.0")
    args = ap.parse_args(argv)
    return {"record": record, "store": store_cmd, "agree": agree_cmd}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
