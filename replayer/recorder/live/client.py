"""Sending the stream with the real ``openai`` client and keeping what the server said.

Requests go out at their arrival times, at most ``concurrency`` in flight
(a request due while all are busy waits for a free one). Each carries its
name as vLLM's ``request_id`` (the engine's id becomes ``cmpl-<name>-0-<suffix>``)
and ``ignore_eos``, so its output length is ``max_tokens`` whatever the random
weights sample. ``client.parquet`` holds, per request: name, the server's
``usage.prompt_tokens_details.cached_tokens``, prompt tokens, latency.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from replayer.recorder.live.server import SERVED_NAME
from replayer.recorder.live.stream import LiveRequest
from traces.io.atomic import write_atomic

CLIENT_FILE = "client.parquet"
CLIENT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("response_id", pa.string()),
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("cached_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("sent_s", pa.float64()),
    pa.field("latency_s", pa.float64()),
])


def send_stream(base_url: str, stream: list[LiveRequest], concurrency: int,
                timeout: float = 600.0) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0)
    slots = threading.Semaphore(concurrency)
    t0 = time.monotonic()

    def one(req: LiveRequest) -> dict:
        try:
            sent = time.monotonic()
            resp = client.completions.create(
                model=SERVED_NAME, prompt=req.prompt, max_tokens=req.max_tokens,
                temperature=0.0, extra_body={"request_id": req.name, "ignore_eos": True})
            latency = time.monotonic() - sent
        finally:
            slots.release()
        details = resp.usage.prompt_tokens_details
        return {"id": req.name, "response_id": resp.id,
                "num_prompt_tokens": resp.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else None,
                "completion_tokens": resp.usage.completion_tokens,
                "sent_s": round(sent - t0, 3), "latency_s": round(latency, 4)}

    futures = []
    with ThreadPoolExecutor(concurrency) as pool:
        for req in stream:
            delay = req.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            slots.acquire()
            futures.append(pool.submit(one, req))
    return [f.result() for f in futures]


def write_client(out: Path, rows: list[dict]) -> Path:
    """``client.parquet`` in ``out``, written whole under a temporary name and
    renamed (:func:`traces.io.atomic.write_atomic`: synced, the umask's mode)."""
    table = pa.Table.from_pylist(rows, schema=CLIENT_SCHEMA)
    write_atomic(Path(out) / CLIENT_FILE, lambda tmp: pq.write_table(table, tmp))
    return Path(out) / CLIENT_FILE


def read_client(trace_dir: Path) -> dict[str, dict]:
    path = Path(trace_dir) / CLIENT_FILE
    if not path.exists():
        raise ValueError(f"{path}: missing (the client's side of a live recording)")
    return {r["id"]: r for r in pq.read_table(path).to_pylist()}
