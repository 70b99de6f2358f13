"""Replays through the real vLLM 0.33 EngineCore: hits, events, goldens, determinism."""

from __future__ import annotations

import io
import json
import shutil
import textwrap

import pytest

from conftest import FIXTURES, MOONCAKE_TRACE as CONVERSATION, SCENARIOS, TRACES, cli
from replayer.replay.execution.clients import replay_on as replay
from traces import load_target
from traces.scenarios.compile import compile_scenario
from traces.trace import read_trace, write_trace


def by_id(result):
    """Each request's outcome as its --json dict, by id."""
    return {r.id: r.as_dict() for r in result.requests}


@pytest.mark.parametrize("turn1", [24576, 24577])
def test_vllm51295_pair_hits_24448_on_033(turn1):
    result = replay(load_target(SCENARIOS / f"vllm51295_turn1_{turn1}.yaml"))
    r = by_id(result)
    assert result.engine.vllm.startswith("0.33")
    assert r["turn1"]["num_cached_tokens"] == 0
    assert r["turn2"]["num_prompt_tokens"] == 50000
    assert r["turn2"]["num_cached_tokens"] == 24448
    assert r["turn2"]["num_local_cached_tokens"] == 24448
    assert r["turn2"]["num_external_cached_tokens"] == 0
    # turn2 arrives once turn1 finished, never before.
    assert r["turn2"]["arrival_step"] > r["turn1"]["finish_step"]
    assert [x.id for x in result.requests] == ["turn1", "turn2"]


def test_priority_policy_decides_who_hits_the_shared_prefix():
    """The recorded policy and priorities matter: fcfs hands the hit to the other request."""
    from dataclasses import replace

    trace = load_target(SCENARIOS / "priority_scheduling.yaml")
    hits = {r.id: r.num_cached_tokens for r in replay(trace).requests}
    assert hits == {"long": 0, "b": 64, "c": 0}
    fcfs = replace(trace, header={**trace.header,
                                  "engine": trace.engine.with_settings(scheduling_policy="fcfs")})
    hits = {r.id: r.num_cached_tokens for r in replay(fcfs).requests}
    assert hits == {"long": 0, "b": 0, "c": 64}


def test_lookahead_hashes_turn_the_eagle_drop_off():
    """Same geometry, drop inactive: the hit lands on a whole block boundary."""
    r = by_id(replay(load_target(SCENARIOS / "pmu_below_block_no_drop.yaml")))
    assert r["turn2"]["num_cached_tokens"] == 24576


def test_scenario_and_its_compiled_trace_replay_identically(tmp_path):
    scenario = SCENARIOS / "shared_system_prompt_hybrid.yaml"
    out = write_trace(compile_scenario(scenario), tmp_path / "trace")
    a = replay(load_target(scenario)).as_dict()
    b = replay(read_trace(out)).as_dict()
    assert a == b


def test_arrival_steps_and_idle_clock_jump(tmp_path):
    path = tmp_path / "arrivals.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {block_size: 16, max_num_batched_tokens: 256}
        requests:
          - {id: a, prompt: [{stream: s, len: 1000}], output_len: 2}
          - {id: b, arrival_step: 500, prompt: [{stream: s, len: 1000}], output_len: 2}
          - {id: c, arrival_step: 1, prompt: [{stream: t, len: 100}], output_len: 2}
        """))
    result = replay(load_target(path))
    r = by_id(result)
    assert [x.id for x in result.requests] == ["a", "c", "b"]        # arrival order
    assert r["c"]["arrival_step"] == 1
    assert r["b"]["arrival_step"] == 500                             # the clock jumped
    assert r["b"]["num_cached_tokens"] == 992                        # a's blocks still cached
    assert result.steps < 100                                        # idle steps cost nothing


def test_abort_event_frees_the_request(tmp_path):
    path = tmp_path / "abort.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {block_size: 16, max_num_batched_tokens: 512}
        requests:
          - {id: long, prompt: [{stream: doc, len: 4000}], output_len: 50}
          - {id: late, arrival_step: 40, prompt: [{stream: doc, len: 4000}], output_len: 2}
        events:
          - {at_step: 3, action: abort, target: long}
        """))
    r = by_id(replay(load_target(path)))
    assert r["long"]["aborted"] and r["long"]["finish_step"] == 3
    assert r["long"]["num_cached_tokens"] is None                    # never finished prefill
    # The three 512-token chunks it computed before the abort stay cached.
    assert r["late"]["num_cached_tokens"] == 1536


def test_reset_prefix_cache_event_empties_the_cache():
    r = by_id(replay(load_target(SCENARIOS / "reset_prefix_cache.yaml")))
    assert r["after_reset"]["num_cached_tokens"] == 0
    assert r["again"]["num_cached_tokens"] == 2992


def test_progress_bar_only_when_enabled():
    from replayer.cli.progress import ProgressBar
    from replayer.replay.loop import Progress

    shown = io.StringIO()
    bar = ProgressBar(stream=shown, delay=0, interval=0, enabled=True)
    bar(Progress(done=3, total=10, steps=7, prompt_tokens=100, cached_tokens=25))
    bar.close()
    assert "3/10 requests" in shown.getvalue() and "7 steps" in shown.getvalue()
    assert "25.0%" in shown.getvalue()
    piped = io.StringIO()                                    # not a terminal
    bar = ProgressBar(stream=piped, delay=0, interval=0)
    bar(Progress(done=3, total=10, steps=7, prompt_tokens=100, cached_tokens=25))
    bar.close()
    assert piped.getvalue() == ""


def test_check_over_a_folder_finds_every_scenario_and_trace_directory():
    """``check fixtures/`` checks every scenario and trace directory below it, and
    nothing else (the Mooncake JSONL and README beside them). That each of them
    passes on the installed vLLM is the golden-fixtures phase of run-tests.sh
    (``pytest fixtures/ --replayer-engine installed``): a second replay of them all
    here, conversation_500's 7.1M prompt tokens included, proved nothing more."""
    from replayer.cli.check import expand_targets

    found = expand_targets(["fixtures/"])
    want = sorted([*FIXTURES.rglob("*.yaml"),
                   *(p for p in TRACES.iterdir() if (p / "header.json").exists())])
    assert sorted(p.resolve() for p in found) == [p.resolve() for p in want]
    assert len(want) > 40


def test_check_over_folders_passes_and_skips_what_the_installed_vllm_removed():
    """fixtures/releases/ holds geometry the installed vLLM removed: SKIP, said why,
    exit 0 beside the targets that PASS (a scenario and a recorded trace)."""
    older = sorted(FIXTURES.glob("releases/*.yaml"))
    proc = cli("check", "fixtures/releases/", "fixtures/scenarios/reset_prefix_cache.yaml",
               "fixtures/traces/live_store_llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert older
    assert proc.stdout.count("PASS ") == 2
    assert [line.split(":")[0] for line in proc.stdout.splitlines()
            if line.startswith("SKIP ")] == [f"SKIP {p.relative_to(FIXTURES.parent)}"
                                             for p in older]
    assert "FAIL" not in proc.stdout


def test_failing_check_then_update_golden(tmp_path):
    scenario = tmp_path / "s.yaml"
    text = (SCENARIOS / "vllm51295_turn1_24577.yaml").read_text()
    assert "turn2: {num_cached_tokens: 24448}" in text
    scenario.write_text(text.replace("turn2: {num_cached_tokens: 24448}",
                                     "turn2: {num_cached_tokens: 23040}"))
    proc = cli("check", str(scenario))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
    assert "first divergence: request turn2" in proc.stdout
    assert "expected 23040, got 24448" in proc.stdout
    assert "over by 1408 tokens = 11 prefix-match unit(s) of 128" in proc.stdout

    before = scenario.read_text()
    proc = cli("check", "--update-golden", str(scenario))
    assert proc.returncode == 1                     # a rewrite is always reviewed
    assert "UPDATED" in proc.stdout
    after = scenario.read_text()
    assert "turn2: {num_cached_tokens: 24448}" in after
    # Only the expect block changed: description and engine are kept byte for byte.
    assert after.split("expect:")[0] == before.split("expect:")[0]

    proc = cli("check", str(scenario))
    assert proc.returncode == 0, proc.stdout
    assert "PASS" in proc.stdout


def test_trace_without_goldens_fails_check(tmp_path):
    out = write_trace(compile_scenario(SCENARIOS / "reset_prefix_cache.yaml"), tmp_path / "t")
    shutil.rmtree(out / "golden")
    proc = cli("check", str(out))
    assert proc.returncode == 1
    assert proc.stdout == (f"FAIL {out}: no goldens for engine vllm==0.33.0 (record them with "
                           "--update-golden); not replayed\n")


def test_check_says_no_goldens_before_replaying(tmp_path):
    """A target without goldens for the engine is not replayed at all: this one would
    stop the replay (exit 2), and a release would be fetched first (exit 2 here)."""
    path = tmp_path / "nofit.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {block_size: 16, num_gpu_blocks: 8}
        requests:
          - {id: big, prompt: [{stream: doc, len: 3000}]}
        expect:
          "vllm==0.29.0": {big: {num_cached_tokens: 0}}
        """))
    proc = cli("check", str(path))
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout == (f"FAIL {path}: no goldens for engine vllm==0.33.0 (record them "
                           "with --update-golden); not replayed\n")
    proc = cli("check", str(path), "--engine", "vllm==0.31.0",
               env={"PREFIX_REPLAYER_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"})
    assert (proc.returncode, proc.stderr) == (1, "")
    assert "no goldens for engine vllm==0.31.0" in proc.stdout
    assert not (tmp_path / "cache").exists()        # nothing fetched


def test_json_is_byte_identical_whatever_the_shell_hash_seed(tmp_path):
    engine = tmp_path / "engine.yaml"
    engine.write_text(textwrap.dedent("""\
        engine:
          block_size: 32
          kv_groups: [{kind: full_attention}]
          speculative: {method: eagle, num_speculative_tokens: 2}
          max_num_batched_tokens: 8192
          max_num_seqs: 64
          num_gpu_blocks: 6000
        """))
    trace = tmp_path / "conv"
    proc = cli("import", "mooncake", str(CONVERSATION), "-o", str(trace), "--limit", "120",
               "--engine", str(engine))
    assert proc.returncode == 0, proc.stderr
    outs = []
    for seed in ("1", "random"):
        out = tmp_path / f"out-{seed}.json"
        proc = cli("run", str(trace), "--json", str(out), env={"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""                    # vLLM stays quiet without --verbose
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert data["engine"] == {"vllm": "0.33.0", "source": "installed"}
    assert data["summary"]["requests"] == 120 == len(data["requests"])
    assert [r["id"] for r in data["requests"]] == [str(i) for i in range(120)]
    for r in data["requests"]:
        assert set(r) >= {"id", "num_prompt_tokens", "num_cached_tokens",
                          "num_local_cached_tokens", "num_external_cached_tokens"}
    assert data["summary"]["cached_tokens"] == sum(r["num_cached_tokens"] for r in data["requests"])
    assert data["summary"]["cached_tokens"] > 0


def test_engine_that_cannot_hold_one_request_is_bad_input(tmp_path):
    path = tmp_path / "nofit.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {block_size: 16, num_gpu_blocks: 8}
        requests:
          - {id: big, prompt: [{stream: doc, len: 3000}]}
        """))
    proc = cli("run", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"replayer: error: {path}: vLLM 0.33.0 cannot build")   # names the file


def test_group_hits_explain_which_group_stopped_the_hit():
    """Sparse Mamba retention: attention alone could serve the shared system
    prompt, Mamba has no state there, so the hybrid hit is Mamba's."""
    from traces.model.gaps import explain_groups

    result = replay(load_target(SCENARIOS / "shared_system_prompt_hybrid.yaml"))
    assert result.kv_groups == [
        {"group": 0, "kind": "full_attention", "eagle_drop": True},
        {"group": 1, "kind": "mamba", "eagle_drop": False}]
    r = by_id(result)
    assert r["user_b"]["group_hits"] == [4480, 0] and r["user_b"]["num_cached_tokens"] == 0
    assert r["user_c"]["group_hits"] == [4480, 3072]
    assert r["user_c"]["num_cached_tokens"] == min(r["user_c"]["group_hits"])
    why = explain_groups(result.by_id()["user_c"], result.kv_groups)
    assert why.endswith("the hit stopped at 3072, where group 1 (mamba) stopped")
    assert "group 0 (full_attention, EAGLE drop applied) alone could hit 4480" in why
