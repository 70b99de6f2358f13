"""A scenario compiled to a trace directory reads back as the same trace."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from conftest import REPO, cli
from helpers_traces import SMALL_SCENARIO, listing, write_text
from traces import SCHEMA_VERSION, load_target, read_trace, write_trace
from traces.materialize import TokenSource
from traces.scenarios.compile import compile_scenario
from traces.model.tokens import stream_tokens
from traces.goldens.kind import golden_file


def assert_same_trace(a, b) -> None:
    assert a.header == b.header
    assert a.requests.schema.equals(b.requests.schema)
    assert a.requests.equals(b.requests)
    for name in ("events", "outcomes", "steps", "store_ops"):
        ta, tb = a.table(name), b.table(name)
        assert (ta is None) == (tb is None), name
        if ta is not None:
            assert ta.equals(tb), name
    assert a.goldens == b.goldens


def test_scenario_round_trip(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    trace = compile_scenario(src)
    out = write_trace(trace, tmp_path / "out")
    back = read_trace(out)
    assert_same_trace(trace, back)
    assert back.requests["id"].to_pylist() == ["a", "b", "c"]
    assert back.requests["after"].to_pylist() == [None, "a", None]
    assert back.requests["arrival_step"].to_pylist() == [0, None, 4]
    assert back.requests["num_prompt_tokens"].to_pylist() == [47, 49, 33]
    assert back.requests["output_len"].to_pylist() == [3, 2, 1]
    assert back.requests["cache_salt"].to_pylist() == [None, "salty", None]
    assert back.events.to_pylist() == [
        {"after": "a", "at_step": None, "action": "reset_prefix_cache", "target": None,
         "group": None, "keys": None, "op": None, "code": None, "times": None}]
    assert back.header["schema_version"] == SCHEMA_VERSION
    assert back.header["source"] == {"kind": "authored", "from": "s.yaml"}
    assert back.header["description"] == "small round-trip scenario"
    # no temporary or backup directory is left beside the trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.yaml"]


def test_goldens_from_expect_survive_round_trip(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    out = write_trace(compile_scenario(src), tmp_path / "out")
    assert (out / "golden" / golden_file("*")).is_file()
    back = read_trace(out)
    assert back.goldens == {"*": {"b": {"num_cached_tokens": 32, "num_prompt_tokens": 49},
                                  "c": {"num_cached_tokens": 0}}}
    # the golden table is plain Parquet with the engine key in its metadata
    table = pq.read_table(out / "golden" / golden_file("*"))
    assert table.schema.metadata[b"engine"] == b"*"
    assert table["id"].to_pylist() == ["b", "c"]


def test_engine_keyed_goldens_round_trip(tmp_path):
    scenario = SMALL_SCENARIO.split("expect:")[0] + (
        'expect:\n'
        '  "vllm==0.29.0": {b: {num_cached_tokens: 0}}\n'
        '  "vllm==0.30.0": {b: {num_cached_tokens: 32}, a: {num_cached_tokens: 0}}\n')
    src = write_text(tmp_path / "s.yaml", scenario)
    trace = compile_scenario(src)
    out = write_trace(trace, tmp_path / "out")
    assert sorted(p.name for p in (out / "golden").iterdir()) == [
        "vllm-0.29.0.parquet", "vllm-0.30.0.parquet"]
    back = read_trace(out)
    assert back.goldens == trace.goldens == {
        "vllm==0.29.0": {"b": {"num_cached_tokens": 0}},
        "vllm==0.30.0": {"b": {"num_cached_tokens": 32}, "a": {"num_cached_tokens": 0}}}


def test_compiled_tokens_are_the_spans(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    back = read_trace(write_trace(compile_scenario(src), tmp_path / "out"))
    v = 32000
    want = [
        np.concatenate([stream_tokens("doc", 0, 40, v), stream_tokens("q1", 0, 7, v)]),
        np.concatenate([stream_tokens("doc", 0, 40, v), stream_tokens("q2", 5, 9, v)]),
        stream_tokens("other", 0, 33, v),
    ]
    src_tokens = TokenSource(back.header, back.requests)
    for row, tokens in enumerate(want):
        assert back.requests["prompt_tokens"][row].as_py() == tokens.tolist()
        np.testing.assert_array_equal(src_tokens.prompt(row), tokens)
    # the shared 40-token document is the same tokens in both requests; the questions differ
    a, b = src_tokens.prompt(0), src_tokens.prompt(1)
    np.testing.assert_array_equal(a[:40], b[:40])
    assert not np.array_equal(a[40:47], b[40:47])


def test_rewrite_replaces_trace_atomically(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    out = write_trace(compile_scenario(src), tmp_path / "out")
    src2 = write_text(tmp_path / "s2.yaml", SMALL_SCENARIO.replace("len: 33", "len: 12")
                      .split("expect:")[0])
    write_trace(compile_scenario(src2), out, force=True)
    back = read_trace(out)
    assert back.requests["num_prompt_tokens"].to_pylist() == [47, 49, 12]
    assert back.goldens == {}
    assert not (out / "golden").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.yaml", "s2.yaml"]


def test_load_target_scenario_equals_compiled_dir(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    out = write_trace(compile_scenario(src), tmp_path / "out")
    from_yaml, from_dir = load_target(src), load_target(out)
    assert from_yaml.requests.equals(from_dir.requests)
    assert from_yaml.goldens == from_dir.goldens
    assert from_yaml.header == from_dir.header


def test_fixture_scenarios_round_trip(tmp_path):
    scenarios = sorted((REPO / "fixtures" / "scenarios").glob("*.yaml"))
    assert scenarios, "no fixture scenarios found"
    for i, path in enumerate(scenarios):
        trace = compile_scenario(path)
        back = read_trace(write_trace(trace, tmp_path / f"t{i}"))
        assert_same_trace(trace, back)


def test_cli_compile_writes_the_same_trace(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    proc = cli("compile", src, "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "3 requests" in proc.stdout
    assert_same_trace(compile_scenario(src), read_trace(tmp_path / "out"))
    header = json.loads((tmp_path / "out" / "header.json").read_text())
    assert header["schema_version"] == SCHEMA_VERSION
    assert listing(tmp_path) == {"s.yaml", "out", "out/header.json", "out/requests.parquet",
                                 "out/events.parquet", "out/golden", "out/golden/*.parquet"}
