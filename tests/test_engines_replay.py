"""Replays on other vLLM builds: real 0.29.0 and 0.33.0 sources, a patched tree.

Bisect over a tree's commits is the console block of docs/engines.md that runs it
(tests/test_readme.py: its output, and the checkout left untouched); it is not
run a second time here.

Releases come from the wheel cache (``$PREFIX_REPLAYER_CACHE``, else
``~/.cache/prefix-replayer``): the first run on a clean machine downloads
vllm==0.29.0 and vllm==0.33.0 once (about 330 MB each) and keeps only their
Python sources. Every other engine here is a copy of the installed package.
"""

from __future__ import annotations

import json

import pytest

from conftest import SCENARIOS, TRACES, cli
from helpers_engines import copy_vllm_sources, patch_eagle_drop
from traces import load_target

PAIR = ("vllm51295_turn1_24576", "vllm51295_turn1_24577")

pytestmark = pytest.mark.slow       # each engine process costs ~10 s of vLLM imports


def test_0290_checks_the_pair_against_its_own_goldens_and_says_each_note_once():
    """0.29.0 shows the #51295 miss as upstream reported it: 23040, then a full miss.

    Every other fixture on 0.29.0 is checked once, by the plugin's phase of the
    suite (``pytest fixtures/ --replayer-engine vllm==0.29.0``) and docs/engines.md's
    ``check --engine vllm==0.29.0 fixtures/`` block; here only what the CLI says."""
    goldens = {name: load_target(SCENARIOS / f"{name}.yaml").goldens for name in PAIR}
    assert goldens["vllm51295_turn1_24576"]["vllm==0.29.0"]["turn2"]["num_cached_tokens"] == 23040
    assert goldens["vllm51295_turn1_24577"]["vllm==0.29.0"]["turn2"]["num_cached_tokens"] == 0
    for name in PAIR:
        assert goldens[name]["vllm==0.33.0"]["turn2"]["num_cached_tokens"] == 24448

    targets = [f"fixtures/scenarios/{name}.yaml"
               for name in (*PAIR, "pmu_below_block_no_drop", "eagle_draft_group")]
    proc = cli("check", "--engine", "vllm==0.29.0", *targets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in PAIR:
        assert (f"PASS fixtures/scenarios/{name}.yaml: 2 request(s) match the goldens for "
                "vllm==0.29.0 (engine vllm==0.29.0)") in proc.stdout
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count("PASS ") == len(targets)
    # The settings 0.29 lacks are said once each, on stderr, and nothing else is
    # (but the fetch's progress lines, the first time the release is used).
    said = [line for line in proc.stderr.splitlines()
            if not line.startswith("replayer: fetching vllm==0.29.0: ")]
    assert said == ["replayer: note: vLLM 0.29.0 has no lookahead block hashes: replayed "
                    "with the EAGLE drop on (engine.speculative."
                    "disable_lookahead_block_hashes is 0.33's)",
                    "replayer: note: vLLM 0.29.0 has no is_draft: every KV-cache group is an "
                    "EAGLE group, so engine.speculative.draft_group only places the draft "
                    "layer (it is 0.33's)"]


# 0.26-0.28 (the 0.29 adapter's range extended down): 0.28.0 on the four fixtures
# the 0.29.0 test checks and mtp_draft_group (no MTP group found before 0.31, the
# draft's layer listed last), 0.26.0 and 0.27.1 on the pair's 24577 side alone (each
# release costs an engine process; their goldens for the four are all filed).
OLDER = {"0.28.0": (*PAIR, "pmu_below_block_no_drop", "eagle_draft_group", "mtp_draft_group"),
         "0.27.1": ("vllm51295_turn1_24577",),
         "0.26.0": ("vllm51295_turn1_24577",)}


@pytest.mark.parametrize("version", OLDER)
def test_releases_before_0290_check_against_their_own_goldens(version):
    """0.26-0.28 miss #51295's turn 2 as 0.29.0 does (23040 after 24576 tokens, 0
    after 24577), through the 0.29 adapter; the retention interval they read from
    VLLM_PREFIX_CACHE_RETENTION_INTERVAL is the trace's (0), not the dense default."""
    goldens = {name: load_target(SCENARIOS / f"{name}.yaml").goldens for name in PAIR}
    assert goldens["vllm51295_turn1_24576"][f"vllm=={version}"]["turn2"] == {
        "num_cached_tokens": 23040}
    assert goldens["vllm51295_turn1_24577"][f"vllm=={version}"]["turn2"] == {
        "num_cached_tokens": 0}
    targets = [f"fixtures/scenarios/{name}.yaml" for name in OLDER[version]]
    proc = cli("check", "--engine", f"vllm=={version}", *targets,
               env={"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "4096"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS ") == len(targets), proc.stdout
    assert (f"PASS fixtures/scenarios/vllm51295_turn1_24577.yaml: 2 request(s) match the "
            f"goldens for vllm=={version} (engine vllm=={version})") in proc.stdout


def test_installed_and_release_0330_give_identical_output():
    """The same release from the wheel's sources replays exactly as the installed one."""
    from replayer.replay.execution.clients import engine_runner, replay_on

    names = [*PAIR, "sliding_window", "reset_prefix_cache", "shared_system_prompt_hybrid"]
    traces = [load_target(SCENARIOS / f"{n}.yaml") for n in names]
    with engine_runner("vllm==0.33.0") as release:
        seen = []
        on_release = [release(t, progress=seen.append) for t in traces]
    assert seen and seen[-1].done == seen[-1].total          # progress crossed the process
    on_installed = [replay_on(t) for t in traces]
    for name, a, b in zip(names, on_installed, on_release):
        assert a.engine.as_dict() == {"vllm": "0.33.0", "source": "installed"}
        assert b.engine.as_dict() == {"vllm": "0.33.0", "source": "release"}
        da, db = a.as_dict(), b.as_dict()
        da.pop("engine"), db.pop("engine")
        assert da == db, name
    assert {r.id: r.num_cached_tokens for r in on_release[1].requests} == {
        "turn1": 0, "turn2": 24448}


def test_patched_tree_changes_51295_and_diff_shows_it(tmp_path):
    tree = copy_vllm_sources(tmp_path / "vllm", bytecode=True)
    patch_eagle_drop(tree)
    out = tmp_path / "diff.json"
    proc = cli("diff", SCENARIOS / "vllm51295_turn1_24577.yaml", "--engine", "installed",
               "--engine", tree, "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["request", "A", "cached", "B", "cached", "delta"]
    assert lines[1].split() == ["turn2", "24448", "23040", "-1408"]     # only what differs
    assert f"B: vllm 0.33.0 (tree {tree})" in lines
    assert lines[-1] == "2 requests: 0 gained, 1 lost, 1 unchanged; tokens gained on B: -1408"
    data = json.loads(out.read_text())
    assert data["a"] == {"vllm": "0.33.0", "source": "installed"}
    assert data["b"] == {"vllm": "0.33.0", "source": "tree", "path": str(tree),
                         "commit": None, "dirty": None}
    assert data["identical"] is False
    assert data["requests"] == [{
        "id": "turn2", "delta": -1408,
        "a": {"num_cached_tokens": 24448, "num_local_cached_tokens": 24448,
              "num_external_cached_tokens": 0},
        "b": {"num_cached_tokens": 23040, "num_local_cached_tokens": 23040,
              "num_external_cached_tokens": 0}}]
    assert data["summary"] == {"requests": 2, "gained": 0, "lost": 1, "unchanged": 1,
                               "tokens_gained": -1408}


def test_store_fixture_replays_on_0320_through_the_store_adapter():
    """0.32's MooncakeStore API is 0.33's: the #56615 resend hits as after the fix."""
    proc = cli("check", "--engine", "vllm==0.32.0", "fixtures/store/resend_after_reset.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("PASS fixtures/store/resend_after_reset.yaml: 6 request(s)")
    assert "store: " in proc.stdout and "FAIL" not in proc.stdout


def test_0320_finds_an_mtp_drafters_group_by_its_last_layer():
    """0.31 and 0.32 flag the group holding the last registered KV layer as an MTP
    drafter's (``_annotate_eagle_groups``); a real drafter registers after the
    target, so the null executor lists the draft's layer last. With a twin last,
    0.32 flagged the window group and hit 32, 0 and 64 here, 0.29's fallback."""
    from replayer.replay.engines.config.engine_config import plan_layers

    engine = load_target(SCENARIOS / "mtp_draft_group.yaml").engine
    assert [p.draft for p in plan_layers(engine, 2)] == [False, False, False, True]
    goldens = load_target(SCENARIOS / "mtp_draft_group.yaml").goldens
    again = {v: goldens[f"vllm=={v}"]["b97_again"]["num_cached_tokens"]
             for v in ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")}
    assert again == {"0.29.0": 32, "0.30.0": 32, "0.31.0": 64, "0.32.0": 64, "0.33.0": 64}
    proc = cli("check", "--engine", "vllm==0.32.0", "fixtures/scenarios/mtp_draft_group.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("PASS fixtures/scenarios/mtp_draft_group.yaml: 6 request(s)")
    assert "no is_draft" not in proc.stderr
