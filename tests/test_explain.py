"""``replayer explain``: every lost token has a cause, on every fixture, on real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from conftest import REPO, cli, cli_here
from helpers_traces import assert_bad_input
from traces import load_target
from replayer.analysis.explain import CAUSES
from replayer.analysis.explain import explain as explain_with
from replayer.replay.execution.clients import engine_runner


def explain(trace):
    """Explained on the installed vLLM, through the one way an engine opens."""
    with engine_runner() as run:
        return explain_with(trace, run)

FIXTURES = REPO / "fixtures"
# chunked_local_attention: explain refuses it (test below).
CHUNKED = FIXTURES / "scenarios" / "chunked_local_attention.yaml"
ALL = sorted([*FIXTURES.glob("scenarios/*.yaml"), *FIXTURES.glob("store/*.yaml"),
              FIXTURES / "traces" / "conversation_500"])
ALL.remove(CHUNKED)
# A prefill/decode pair: explain refuses it (test below).
PD_PAIR = FIXTURES / "store" / "pd_pair_shared_store.yaml"
ALL.remove(PD_PAIR)


def test_explain_refuses_a_chunked_local_group_in_one_line():
    """vLLM counts tokens before the current chunk as computed without a cache:
    there is no reachable hit to compare with, so explain says so and replays nothing."""
    proc = cli("explain", CHUNKED)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(CHUNKED.relative_to(REPO)) in lines[0] or str(CHUNKED) in lines[0]
    assert "explain cannot account for a chunked_local group" in lines[0]
    assert proc.stdout == ""


@pytest.mark.slow
def test_explain_refuses_a_prefill_decode_pair_in_one_line():
    """The decode side's hits come from the request's own prefill on the other
    instance: no reuse between requests to compare with; said before any replay."""
    proc = cli_here("explain", PD_PAIR)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "explain cannot account for a prefill/decode pair" in lines[0]
    assert proc.stdout == ""


# conversation_500 on a slice: its first 120 requests by arrival (the importer's
# conv120 of test_segments and test_gc_tuning), their goldens the fixture's own.
# Its 131,072 blocks never evict and the queue is first come, first served, so a
# request's hit depends on earlier arrivals only; all 500 (7.1M prompt tokens,
# explained by several replays) cost minutes for the same rules.
CONVERSATION_SLICE = 120


def _explained_target(target):
    """The fixture as explained here: conversation_500 cut to its first requests."""
    trace = load_target(target)
    if target.name != "conversation_500":
        return trace
    import dataclasses

    kept = trace.requests.slice(0, CONVERSATION_SLICE)
    ids = set(kept.column("id").to_pylist())
    goldens = {k: {rid: v for rid, v in gold.items() if rid in ids}
               for k, gold in trace.goldens.items()}
    assert all(len(g) == CONVERSATION_SLICE for g in goldens.values()), "goldens lost"
    return dataclasses.replace(trace, requests=kept, goldens=goldens)


@pytest.mark.parametrize("target", ALL, ids=lambda p: p.stem if p.suffix else p.name)
def test_causes_add_up_and_nothing_is_unexplained(target):
    """Every fixture; on the fixtures a rule of explain is about, that rule too
    (FIXTURE_CHECKS below): one explain of each fixture serves both."""
    trace = _explained_target(target)
    ex = explain(trace)
    for check in FIXTURE_CHECKS.get(target.name, ()):
        check(ex, trace)
    t = ex.table
    lost = sum(t[f"lost_{c}"] for c in CAUSES)
    assert (t["reachable"] - t["actual"] == lost).all()
    assert t["lost_unexplained"].abs().sum() == 0, t.filter(pl.col("lost_unexplained") != 0)
    s = ex.summary()
    assert s["reachable"] - s["actual"] == sum(s["lost"].values())
    # The baseline is the plain replay: its hits are the goldens'.
    gold = next(iter(v for k, v in trace.goldens.items()
                     if k in ("*", "vllm==0.33.0")), None)
    if gold:
        actual = dict(zip(t["id"].to_list(), t["actual"].to_list()))
        for rid, fields in gold.items():
            if "num_cached_tokens" in fields:
                # A golden of null (never prefilled: its store load failed) is 0 hit.
                assert actual[rid] == (fields["num_cached_tokens"] or 0), rid


def _lost(ex, rid: str) -> dict[str, int]:
    row = ex.table.filter(pl.col("id") == rid).row(0, named=True)
    return {c: row[f"lost_{c}"] for c in CAUSES if row[f"lost_{c}"]}


# Each known miss lands on the cause its fixture is about (checked on the
# fixture's one explain in test_causes_add_up_and_nothing_is_unexplained).

def _eagle_drop_is_named(ex, trace):
    assert _lost(ex, "turn2") == {"eagle_drop": 128}          # the EAGLE drop, 1 PMU


def _reset_is_named(ex, trace):
    assert _lost(ex, "after_reset") == {"reset": 2992}


def _sparse_retention_is_named(ex, trace):
    # Mamba state exists only at user_a's prompt end: nothing to resume user_b from.
    assert _lost(ex, "user_b") == {"sparse_retention": 5888}
    assert ex.evidence["sparse_retention"].startswith("replay with dense")


def test_a_mamba_state_never_written_is_said_in_terms_a_reader_can_check():
    """live_qwen3_next: the baseline and the dense-checkpoint replay both hit 24.9%,
    yet 256 tokens go to sparse_retention (issue 30). They are request r0001's
    share of r0000's first block, where no Mamba state was ever written (r0000
    prefilled 1024 tokens in one chunk; the junction is found by r0001's own
    lookup, and r0002 on hit it). The output splits the two parts and says so."""
    from replayer.analysis.explain_tables import render

    ex = explain(load_target(FIXTURES / "traces" / "live_qwen3_next"))
    first = "cmpl-r0001-0-8d3a95de"
    assert _lost(ex, first) == {"sparse_retention": 256}
    assert ex.summary()["lost"]["sparse_retention"] == 256
    assert ex.replays[0]["summary"]["hit_rate"] == ex.replays[-1]["summary"]["hit_rate"]
    assert ex.mamba_short == {first: (0, 256)}
    said = ex.evidence["sparse_retention"]
    assert said.startswith("replay with dense Mamba/SWA checkpoints minus the previous (0), "
                           "plus where vLLM's per-group lookup"), said
    assert "shows a Mamba group had no state (256); " in said
    assert "dense retention keeps every state written, it writes none" in said
    text = render(ex, top=1)
    assert ("    256 of its sparse_retention: on the last replay (prefix_cache_retention_"
            "interval: null (dense checkpoints)) the Mamba groups had state up to 0 of the 256 "
            "it shares: none was written at 256") in text, text


def test_capacity_is_what_an_unbounded_cache_gets_back(tmp_path):
    scen = tmp_path / "tiny_cache.yaml"
    scen.write_text("""\
engine: {block_size: 16, num_gpu_blocks: 24, max_num_seqs: 2, max_num_batched_tokens: 512}
requests:
  - {id: a, prompt: [{stream: doc, len: 300}]}
  - {id: b, after: a, prompt: [{stream: other, len: 300}]}
  - {id: c, after: b, prompt: [{stream: doc, len: 300}]}
""")
    ex = explain(load_target(scen))
    # 24 blocks hold one 300-token request: b evicts most of a's blocks.
    lost = _lost(ex, "c")
    assert set(lost) == {"capacity"} and 0 < lost["capacity"] <= 288, lost
    row = ex.table.filter(pl.col("id") == "c").row(0, named=True)
    assert row["reachable"] == 288 and row["actual"] == 288 - lost["capacity"]
    assert "num_gpu_blocks=" in ex.replays[1]["change"]


@pytest.mark.slow
def test_cli_json_parquet_and_set(tmp_path):
    target = FIXTURES / "scenarios" / "vllm51295_turn1_24577.yaml"
    out = []
    for k in range(2):
        proc = cli("explain", str(target), "--json", tmp_path / f"x{k}.json",
                   "--parquet", tmp_path / f"x{k}.parquet", timeout=600)
        assert proc.returncode == 0, proc.stderr
        out.append((tmp_path / f"x{k}.json").read_bytes())
    assert out[0] == out[1]                                   # byte-identical across runs
    assert "eagle_drop" in proc.stdout and "top 1 request(s) by lost tokens" in proc.stdout
    doc = json.loads(out[0])
    req = {r["id"]: r for r in doc["requests"]}
    assert req["turn2"] == {"id": "turn2", "reachable": 24576, "actual": 24448,
                            "reachable_from": "turn1",
                            "lost": {**dict.fromkeys(CAUSES, 0), "eagle_drop": 128}}
    assert doc["summary"]["lost"]["unexplained"] == 0
    assert set(doc["summary"]) >= {"reachable", "actual", "lost"}
    table = pl.read_parquet(tmp_path / "x0.parquet")
    assert table["reachable"].to_list() == [0, 24576]
    # What-if: lookahead block hashes back on, the drop goes away.
    proc = cli("explain", str(target), "--json", "-", "--set",
               "engine.speculative.disable_lookahead_block_hashes=false", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert {r["id"]: r["actual"] for r in doc["requests"]}["turn2"] == 24576


@pytest.mark.parametrize("opt, needle", [
    ("engine.blok_size=16", "unknown engine key 'blok_size'"),
    ("block_size=16", "must start with 'engine.'"),
    ("engine.block_size", "expected engine.KEY=VALUE"),
    ("engine.block_size=[1", "not YAML"),
    ("engine.kv_groups=[{kind: linear}]", "kind 'linear'"),
    ("engine.block_size.x=1", "is not a mapping"),
])
def test_bad_set_is_one_line(tmp_path, opt, needle):
    target = FIXTURES / "scenarios" / "reset_prefix_cache.yaml"
    for cmd in ("run", "explain"):          # refused before any engine: in this process
        proc = cli_here(cmd, str(target), "--set", opt, "--json", tmp_path / "x.json")
        assert_bad_input(proc, needle)
        assert not (tmp_path / "x.json").exists()


def test_set_changes_the_replay(tmp_path):
    target = FIXTURES / "scenarios" / "reset_prefix_cache.yaml"
    proc = cli("run", str(target), "--set", "engine.block_size=32", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert {r["id"]: r["num_cached_tokens"] for r in doc["requests"]}["again"] == 2976


def test_preemption_evidence_comes_from_the_adapter():
    """explain states that a preemption never changes a hit only where the
    engine's adapter says so (EngineAdapter.hits_are_first_prefill)."""
    from replayer.replay.engines.base import EngineInfo
    from replayer.analysis.explain import preemption_evidence
    from replayer.replay.loop import ReplayResult

    said = ReplayResult(engine=EngineInfo(vllm="0.33.0"), requests=[], steps=0,
                        hits_are_first_prefill=True)
    unknown = ReplayResult(engine=EngineInfo(vllm="0.33.0"), requests=[], steps=0)
    assert "never changes a reported hit" in preemption_evidence(said)
    assert "not measured" in preemption_evidence(unknown)
    assert "0.33" not in preemption_evidence(said)


def _a_prefix_shared_below_one_block_is_said(ex, trace):
    """shared_prefix_below_one_block: second shares 100 tokens with first, under
    one 128-token block, so its reachable hit is 0 and nothing is lost; explain
    gives the token-granular figure beside the block-floored one and says why."""
    from dataclasses import replace

    from replayer.analysis.explain_tables import below_unit_line, render

    t = ex.table
    assert t["reachable"].to_list() == [0, 0, 256]
    assert t["shared_tokens"].to_list() == [0, 100, 300]
    assert ex.below_unit == {"second": (100, "first")}       # third's 300 reach 256: a hit
    text = render(ex)
    assert "  second: shared prefix of 100 tokens (with first) is below one block of 128" in text
    # Where the prefix-match unit is below the block, the unit is what a hit needs.
    assert below_unit_line(replace(ex, unit=64), "second").endswith(
        "is below one unit of 64 (the prefix-match unit; block 128)")
    assert ex.as_dict()["below_unit"] == [{"id": "second", "shared_tokens": 100,
                                           "shared_from": "first"}]


def test_shared_tokens_count_salted_prompts_apart(tmp_path):
    """The token-granular figure follows the cache's rules: prompts under another
    cache salt share nothing, and the last prompt token is never counted."""
    from traces.reachable import shared_tokens

    scen = tmp_path / "salted.yaml"
    scen.write_text("""\
engine: {block_size: 16, num_gpu_blocks: 64}
requests:
  - {id: a, prompt: [{stream: s, len: 40}]}
  - {id: b, after: a, cache_salt: x, prompt: [{stream: s, len: 40}]}
  - {id: c, after: b, prompt: [{stream: s, len: 40}]}
  - {id: d, after: c, prompt: [{stream: s, len: 7}, {stream: t, len: 9}]}
""")
    got = shared_tokens(load_target(scen))
    assert dict(zip(got["id"].to_list(), got["shared_tokens"].to_list())) == {
        "a": 0, "b": 0, "c": 39, "d": 7}
    assert got["shared_from"].to_list() == [None, None, "a", "a"]


def _a_store_miss_is_named_by_group_and_boundary(ex, trace):
    """store_remove_named_keys: each resend's store loss names the key its lookup
    missed, by KV-cache group and token boundary, and what removed it."""
    from replayer.analysis.explain_tables import render

    assert _lost(ex, "p7449_again")["store"] == 7296
    said = {rid: [(m.op, m.group, m.boundary, m.how.split(" at ")[0]) for m in ms]
            for rid, ms in ex.store_misses.items()}
    assert said == {"p7449_again": [("lookup", 0, 6144, "removed")],
                    "p23196_again": [("lookup", 1, 21504, "removed")]}
    text = render(ex)
    assert "    store: group 0 (full_attention) @ 6144 was written and is gone (removed at step" \
        in text, text


def _attention_refetched_while_resident_is_a_cost_explain_and_report_show(ex, trace):
    """refetch_resident_attention: the Mamba group is evicted locally, the attention
    group still holds 7296 tokens, yet MooncakeStore (no divergent local hybrid
    hits) loads them again: no token is lost, and the cost is said, from the
    recorded store ops (the gets p7449_again's load made of group 0)."""
    from replayer.analysis.explain_tables import render
    from replayer.analysis.html_report import render_html

    assert _lost(ex, "p7449_again").get("store", 0) == 0
    r = ex.refetched["p7449_again"]
    gets = [g for g in ex.baseline.store["rows"] if g["op"] == "get" and g["group"] == 0
            and g["loader"] == "p7449_again" and g["result"] > 0]
    assert (r.tokens, r.groups, r.local, r.resident) == (7296, (0,), 0, {0: 7296})
    assert r.bytes == sum(g["bytes"] for g in gets) > 0
    assert set(ex.refetched) == {"p7449_again"}
    line = ("  p7449_again: 7296 tokens (%d bytes) fetched from the store while resident "
            "locally: group 0 (full_attention) alone held 7296; the local hit was 0" % r.bytes)
    assert line in render(ex)
    page = render_html(ex, "refetch", trace.header)
    assert '<section id="beside-the-causes">' in page
    assert "p7449_again: 7296 tokens (%d bytes) fetched from the store" % r.bytes in page


# The rules above, each on the fixture it is about (file name -> checks).
FIXTURE_CHECKS = {
    "vllm51295_turn1_24577.yaml": [_eagle_drop_is_named],
    "reset_prefix_cache.yaml": [_reset_is_named],
    "shared_system_prompt_hybrid.yaml": [_sparse_retention_is_named],
    "shared_prefix_below_one_block.yaml": [_a_prefix_shared_below_one_block_is_said],
    "store_remove_named_keys.yaml": [_a_store_miss_is_named_by_group_and_boundary],
    "refetch_resident_attention.yaml":
        [_attention_refetched_while_resident_is_a_cost_explain_and_report_show],
}


def test_every_fixture_check_names_a_fixture_explained():
    assert set(FIXTURE_CHECKS) <= {p.name for p in ALL}


def test_a_store_miss_names_a_key_never_written_or_emptied_away():
    """The rules of a store miss on rows as --store-ops writes them: a key written
    then emptied by remove_all is named with that; with nothing written and gone,
    each group's first missing key past the lookup's hit; a failed get by code."""
    from types import SimpleNamespace

    from replayer.analysis.explain_store import store_misses

    def row(order, op, group, boundary, result, key=None, step=0, loader=None):
        return {"order": order, "step": step, "op": op, "group": group, "boundary": boundary,
                "key": key or f"m@group:{group}@h{boundary}", "result": result,
                "loader": loader, "bytes": 64}

    rows = [row(0, "put", 0, 16, 0), row(1, "remove_all", None, None, 0, key="-", step=2),
            row(2, "lookup", 0, 16, 0, step=3), row(3, "lookup", 1, 16, 0, step=3),
            row(4, "lookup", 0, 32, 1, step=4), row(5, "lookup", 0, 48, 0, step=4),
            row(6, "lookup", 1, 48, 0, step=4), row(7, "lookup", 1, 64, 0, step=4),
            row(8, "get", 0, 32, -900, step=4, loader="b")]
    rows[1]["key"] = None
    lookups = [{"request": "a", "hit_length": 0, "rows": [2, 4]},
               {"request": "b", "hit_length": 32, "rows": [4, 8]}]
    result = SimpleNamespace(store={"rows": rows, "lookups": lookups})
    got = store_misses(result, ["a", "b"])
    kinds = {0: "full_attention", 1: "mamba"}
    assert [m.said(kinds) for m in got["a"]] == [
        "group 0 (full_attention) @ 16 was written and is gone (the store emptied at step 2)"]
    assert [m.said(kinds) for m in got["b"]] == [
        "group 0 (full_attention) @ 48 was never written (the first key past the store's hit)",
        "group 1 (mamba) @ 48 was never written (the first key past the store's hit)",
        "group 0 (full_attention) @ 32: its get returned RPC_FAIL (-900)"]
    assert store_misses(result, ["c"]) == {}


def test_refetched_counts_a_block_once_and_every_rank_s_bytes():
    """At TP 2 each rank fetches its own copy of a block: the bytes add up, the
    tokens do not; a get above what the group held locally is no refetch, nor is
    a Mamba state (one state, not a span of tokens)."""
    from types import SimpleNamespace

    from replayer.analysis.explain_store import refetched

    def get(rank, group, boundary):
        return {"op": "get", "rank": rank, "group": group, "boundary": boundary,
                "result": 100, "bytes": 100, "loader": "b"}

    rows = [get(0, 0, 16), get(1, 0, 16), get(0, 0, 32), get(1, 0, 32), get(0, 0, 48),
            get(0, 1, 32)]
    req = SimpleNamespace(id="b", group_hits=(40, 0), num_local_cached_tokens=0)
    result = SimpleNamespace(
        store={"rows": rows}, by_id=lambda: {"b": req},
        kv_groups=[{"group": 0, "kind": "full_attention"}, {"group": 1, "kind": "mamba"}])
    r = refetched(result, {0: 16, 1: 16})["b"]
    # 16 + 16 tokens of the blocks ending at 16 and 32, 8 of the one ending at 48.
    assert (r.tokens, r.bytes, r.groups, r.resident) == (40, 500, (0,), {0: 40})


def test_a_cpu_tier_s_pending_key_is_said_as_pending_not_as_never_written():
    """A CPU tier's lookup that finds a key still being stored (HIT_PENDING, 2)
    names that key, not the never-written keys vLLM's scan tried below it."""
    from types import SimpleNamespace

    from replayer.analysis.explain_store import store_misses

    rows = [{"order": i, "step": 3, "op": "lookup", "group": g, "boundary": b,
             "key": f"cpu@group:{g}@h{b}", "result": res, "loader": None, "bytes": None}
            for i, (g, b, res) in enumerate([(0, 6144, 1), (0, 7424, 2), (1, 7424, 2),
                                             (0, 7296, 0), (0, 6272, 0)])]
    result = SimpleNamespace(store={"rows": rows, "lookups": [
        {"request": "r", "hit_length": 6144, "rows": [0, len(rows)]}]})
    got = store_misses(result, ["r"])
    assert [m.said({0: "full_attention", 1: "mamba"}) for m in got["r"]] == [
        "group 0 (full_attention) @ 7424 was still being stored (HIT_PENDING: not yet "
        "readable)",
        "group 1 (mamba) @ 7424 was still being stored (HIT_PENDING: not yet readable)"]


def test_a_cpu_tier_eviction_is_a_store_loss_not_capacity():
    """On a CPU offload trace the first counterfactual is a CPU tier that never
    evicts: what the full tier evicted is ``store`` (the key named, evicted), and
    a GPU eviction the tier would have given back is not ``capacity``."""
    trace = load_target(FIXTURES / "offloading" / "cpu_tier_full_evicts_the_prefix.yaml")
    ex = explain(trace)
    lost = _lost(ex, "a_again")
    assert lost["store"] > 0 and lost.get("capacity", 0) == 0, lost
    assert ex.replays[1]["change"].startswith("cpu_bytes_to_use=")
    said = [m.said({0: "full_attention"}) for m in ex.store_misses["a_again"]]
    assert said and "was written and is gone (evicted at step" in said[0], said


def test_a_whole_prompt_load_is_named_not_unexplained():
    """a_again's 1024 of 1024 (240 on the GPU, 784 loaded from the CPU tier): vLLM
    reports every prompt token cached and computes the last one again, while
    reachable stops below it (1008, in units of 16): the 16 above are
    ``whole_prompt``, negative, and nothing is unexplained."""
    trace = load_target(FIXTURES / "offloading" / "gpu_evicted_prefix_returns_from_cpu.yaml")
    ex = explain(trace)
    row = ex.table.filter(pl.col("id") == "a_again").row(0, named=True)
    assert (row["reachable"], row["actual"]) == (1008, 1024)
    assert _lost(ex, "a_again") == {"whole_prompt": -16}
    assert ex.summary()["lost"]["unexplained"] == 0
    assert "_update_waiting_for_remote_kv" in ex.evidence["whole_prompt"]


def test_a_hit_above_reachable_is_whole_prompt_only_at_reachable_s_cap():
    """Above the reachable prefix, only a hit of the whole prompt where reachable is
    its cap (whole units below the last prompt token) is ``whole_prompt``; any
    other hit above it stays ``unexplained`` (a finding)."""
    from types import SimpleNamespace

    from replayer.analysis.explain import _below_the_floor

    def lost_of(reachable, hit, prompt=1024):
        req = SimpleNamespace(id="r", num_cached_tokens=hit, group_hits=None)
        last = SimpleNamespace(requests=[req], by_id=lambda: {"r": req}, kv_groups=None)
        reach = pl.DataFrame({"id": ["r"], "reachable": [reachable],
                              "num_prompt_tokens": [prompt]})
        lost = {c: {"r": 0} for c in CAUSES}
        _below_the_floor(last, reach, 16, 16, lost)
        return {c: v["r"] for c, v in lost.items() if v["r"]}

    assert lost_of(1008, 1024) == {"whole_prompt": -16}
    assert lost_of(992, 1024) == {"unexplained": -32}      # reachable below its cap
    assert lost_of(1008, 1020, prompt=1020) == {"whole_prompt": -12}  # cap: 1019 // 16 units
    assert lost_of(1008, 1024, prompt=1030) == {"unexplained": -16}   # not the whole prompt
