"""vLLM's KV-cache events as goldens: collected from the replayed engine, named by
meaning, checked and rewritten through the one golden path, recorded and
compared against a recording.

The replays run vLLM 0.33's real scheduler with ``enable_kv_cache_events`` on;
only the publisher (ZMQ in production) is fronted by the in-process collector.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pyarrow.parquet as pq
import pytest

from conftest import SCENARIOS, cli
from replayer.check import recorded as fidelity
from replayer.check.goldens import check
from replayer.replay.execution.clients import replay_on
from traces import load_target
from traces.model.errors import TraceError
from traces.goldens.events import EVENTS, compare_events, compress, from_rows
from traces.scenarios.compile import compile_scenario
from traces.trace import read_trace, write_trace

SPARSE = SCENARIOS / "kv_events_sparse_mamba.yaml"
RESET = SCENARIOS / "reset_prefix_cache.yaml"


@pytest.fixture(scope="module")
def sparse():
    trace = load_target(SPARSE)
    return trace, replay_on(trace)


def test_sparse_mamba_keeps_fewer_blocks_than_it_intends(sparse):
    trace, result = sparse
    rows = result.kv_events
    assert rows, "the engine published no KV-cache events"
    stored = [r for r in rows if r["event"] == "BlockStored"]
    kept = [r for r in stored if r["kept"]]
    skipped = [r for r in stored if r["kept"] is False]
    # Full attention keeps every block it stores; the Mamba group only some.
    assert {r["group"] for r in skipped} == {1}
    assert kept and all(r["hash"] and r["boundary"] > 0 and r["request"] for r in kept)
    assert all(r["hash"] is None for r in skipped)
    mamba_kept = sorted(r["boundary"] for r in kept if r["group"] == 1)
    # Mamba state at each prompt's last prefix-match unit and chunk end, not at every block.
    assert 1056 in mamba_kept and 1024 not in mamba_kept
    # Rows are in published order, steps never go back.
    assert [r["order"] for r in rows] == list(range(len(rows)))
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    # The golden matches, and the JSON summary says the same.
    lines, ok = check(SPARSE, trace, result)
    assert ok, "\n".join(lines)
    assert "kv events:" in lines[-1] and "match the event goldens" in lines[-1]
    summary = result.as_dict()["kv_events"]
    assert summary["blocks"] == {"BlockStored": len(kept), "BlockStored (not kept)": len(skipped)}
    assert summary["stored"]["first"]["1"] == [r["boundary"] for r in kept
                                               if r["group"] == 1 and r["request"] == "first"]


def test_a_changed_golden_fails_naming_the_block(sparse, tmp_path):
    trace, result = sparse
    key = result.engine.key
    expect = trace.event_goldens[key]
    bad = {**expect, "stored": {**expect["stored"], "first": {
        **expect["stored"]["first"], 1: [b for b in expect["stored"]["first"][1] if b != 1056]
        + [1024]}}, "cleared": 1}
    trace.event_goldens[key] = bad
    try:
        lines, ok = check(SPARSE, trace, result)
    finally:
        trace.event_goldens[key] = expect
    assert not ok
    assert lines[0].startswith("FAIL") and lines[0].endswith(", but the KV-cache events do not")
    text = "\n".join(lines)
    assert "    missing BlockStored: group 1 @ 1024 (first)" in text
    assert "    extra BlockStored: group 1 @ 1056 (first)" in text
    assert "    AllBlocksCleared: expected 1, got 0" in text


def test_reset_fixture_clears_once_and_stores_again(tmp_path):
    trace = load_target(RESET)
    expect = trace.event_goldens["*"]
    assert expect["cleared"] == 1
    # first's 187 full blocks, stored again after the reset (named by their first request).
    assert Counter(expect["stored"]["first"][0]) == Counter({b: 2 for b in range(16, 3000, 16)})


def test_update_golden_fills_an_empty_block_and_then_passes(tmp_path):
    target = tmp_path / "sparse.yaml"
    text = SPARSE.read_text()
    head = text[:text.index("expect_events:")]
    target.write_text(head + "expect_events: {}   # filled by --update-golden\n")
    proc = cli("check", "--update-golden", target)
    assert proc.returncode == 1, proc.stderr
    assert "kv event goldens rewritten in" in proc.stdout
    again = compile_scenario(target)
    assert again.event_goldens["*"] == load_target(SPARSE).event_goldens["vllm==0.33.0"]
    assert '"1024..' not in target.read_text() and "256..1024/256" in target.read_text()
    proc = cli("check", target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kv events: 17 stored, 7 skipped, 0 removed block(s) and 0 clear(s) match" in proc.stdout


def test_trace_directory_golden_table_and_two_hash_seeds(tmp_path):
    """A trace directory gets golden/events-vllm-X.parquet; the JSON and the events
    table are byte-identical under two interpreter hash seeds."""
    out = tmp_path / "sparse"
    proc = cli("compile", SPARSE, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert any(p.name.startswith("events-") for p in (out / "golden").iterdir())
    got = {}
    for seed in ("0", "4242"):
        j, ev = tmp_path / f"out{seed}.json", tmp_path / f"ev{seed}.parquet"
        proc = cli("run", out, "--json", j, "--kv-events", ev, env={"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        got[seed] = (j.read_bytes(), pq.read_table(ev).to_pylist())
    assert got["0"] == got["4242"]
    data = json.loads(got["0"][0])
    assert data["kv_events"]["blocks"]["BlockStored (not kept)"] == 7
    proc = cli("check", "--update-golden", out)
    assert proc.returncode == 1 and "kv event goldens rewritten in" in proc.stdout
    assert "events-vllm-" in proc.stdout
    proc = cli("check", out)
    assert proc.returncode == 0, proc.stdout
    proc = cli("info", out)
    assert "kv event goldens for vllm==" in proc.stdout or "kv event goldens for any" in proc.stdout


def test_recorder_records_the_events_and_the_replay_matches_them(tmp_path):
    trace = load_target(SPARSE)
    rec = tmp_path / "rec"
    result = fidelity.record_replay(trace, rec)
    recorded = read_trace(rec)
    assert recorded.kv_events is not None
    cols = ("step", "event", "group", "boundary", "kept", "request", "hash")
    table = recorded.kv_events.sort_by("order").to_pylist()
    assert [tuple(r[c] for c in cols) for r in table] == [
        tuple(r[c] for c in cols) for r in result.kv_events]
    lines, ok, _ = fidelity.check_against_recorded(recorded)
    assert ok, "\n".join(lines)
    assert "kv event block(s)" in lines[0]
    # A recording whose events differ is caught: drop the last block.
    tampered = tmp_path / "tampered"
    shutil.copytree(rec, tampered)
    for part in (tampered / "kv_events").glob("*.parquet"):
        t = pq.read_table(part)
        pq.write_table(t.slice(0, t.num_rows - 1), part)
    lines, ok, _ = fidelity.check_against_recorded(read_trace(tampered))
    assert not ok
    assert any(line.strip().startswith("kv_events: ") for line in lines), lines


# -- no vLLM below: the golden kind itself --------------------------------------

def test_runs_compress_and_expand_back():
    values = [16, 32, 48, 64, 1088, 16, 32, 48, 5, 5, 7]
    assert compress(values) == ["16..64/16", 1088, "16..48/16", 5, 5, 7]
    body = {"stored": {"a": {0: compress(values)}}, "cleared": 2}
    parsed = EVENTS.parse_body("s.yaml", "expect_events", body, {"a"})
    assert parsed["stored"]["a"][0] == values
    assert EVENTS.from_table(EVENTS.to_table(parsed, "*"))["stored"]["a"][0] == sorted(
        values, key=values.index)
    assert Counter(EVENTS.from_table(EVENTS.to_table(parsed, "*"))["stored"]["a"][0]) == Counter(
        values)


def test_compare_is_a_multiset_per_section():
    rows = [{"event": "BlockStored", "kept": True, "group": 0, "boundary": 16, "request": "a"},
            {"event": "BlockStored", "kept": True, "group": 0, "boundary": 16, "request": "a"},
            {"event": "BlockStored", "kept": False, "group": 1, "boundary": 16, "request": "a"},
            {"event": "BlockRemoved", "kept": None, "group": 0, "boundary": 16, "request": "a"},
            {"event": "AllBlocksCleared", "kept": None, "group": None, "boundary": None,
             "request": None}]
    got = from_rows(rows)
    assert got == {"stored": {"a": {0: [16, 16]}}, "skipped": {"a": {1: [16]}},
                   "removed": {"a": {0: [16]}}, "cleared": 1}
    assert compare_events(got, got) == []
    # Only the sections a golden holds are checked.
    assert compare_events({"removed": {"a": {0: [16]}}}, got) == []
    diffs = compare_events({"stored": {"a": {0: [16]}}, "cleared": 0}, got)
    assert [d.describe() for d in diffs] == ["extra BlockStored: group 0 @ 16 (a)",
                                            "AllBlocksCleared: expected 0, got 1"]


@pytest.mark.parametrize("block, message", [
    ("{stored: {nobody: {0: [16]}}}", "expect_events.stored names unknown request 'nobody'"),
    ("{kept: {}}", "unknown key 'kept' in expect_events (known: stored, skipped, removed, "
                   "cleared)"),
    ("{stored: {first: {0: ['16..40/16']}}}", "expect_events.stored.first.0[0]: '16..40/16' is "
                                              "not a run"),
    ("{stored: {first: {0: [abc]}}}", "expect_events.stored.first.0[0]: expected a token "
                                      "boundary or a run 'A..B/STEP', got 'abc'"),
    ("{stored: {first: {x: [16]}}}", "expect_events.stored.first group must be an integer"),
    ("{cleared: -1}", "expect_events.cleared must be an integer >= 0"),
    ("{stored: {first: {0: ['1..99999999999/1']}}}", "expand to more than"),
])
def test_bad_event_goldens_are_one_line_errors(tmp_path, block, message):
    text = RESET.read_text()
    target = tmp_path / "bad.yaml"
    target.write_text(text[:text.index("expect_events:")] + f"expect_events: {block}\n")
    with pytest.raises(TraceError) as err:
        compile_scenario(target)
    assert message in str(err.value)
    proc = cli("info", target)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(target) in proc.stderr and message in proc.stderr


def test_a_golden_table_with_repeated_rows_is_refused(tmp_path):
    trace = load_target(RESET)
    out = write_trace(trace, tmp_path / "reset")
    golden = next(p for p in (out / "golden").iterdir() if p.name.startswith("events-"))
    t = pq.read_table(golden)
    import pyarrow as pa

    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), golden)
    proc = cli("info", out)
    assert proc.returncode == 2
    assert "duplicate" in proc.stderr and golden.name in proc.stderr


EVICTING = """\
engine:
  block_size: 16
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 40
requests:
  - {id: a, prompt: [{stream: a, start: 0, len: 400}]}
  - {id: b, after: a, prompt: [{stream: b, start: 0, len: 400}]}
  - {id: c, after: b, prompt: [{stream: a, start: 0, len: 400}]}
expect:
  a: {num_cached_tokens: 0}
expect_events: {}
"""


def test_evicted_blocks_are_removed_by_name(tmp_path):
    """A cache of 40 blocks holds one 400-token prompt: b evicts a's blocks
    (BlockRemoved, named a's), and c, a's prompt again, stores evicted ones anew."""
    target = tmp_path / "evicting.yaml"
    target.write_text(EVICTING)
    trace = load_target(target)
    result = replay_on(trace)
    got = from_rows(result.kv_events)
    removed = got["removed"]
    assert removed.get("a", {}).get(0), got
    stored_once = set(got["stored"]["a"][0])
    assert set(removed["a"][0]) <= stored_once
    assert all(b % 16 == 0 for b in removed["a"][0])
    # c misses the evicted prefix and stores a's blocks a second time.
    assert result.by_id()["c"].num_cached_tokens < 400
    times = Counter(got["stored"]["a"][0])
    assert any(times[b] == 2 for b in removed["a"][0])
