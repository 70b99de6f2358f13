"""Store pressure: a pool of a given size, its evictions, and a full real pool.

``engine.mooncake_global_segment_size`` (Mooncake's per-rank segment) sizes the
memory store a trace replays on, so ``fixtures/store/pressure_evicts_a_prefix_a_
resend_needs.yaml`` can hold goldens for a resend that the store no longer
serves (the plugin phase checks them on every release). These tests check what
the goldens cannot say: that the miss comes from evictions (which keys, when),
that a larger pool or more ranks keep the prefix, that the recorder carries the
segment into a recording, and the bad input. The real master's side (it never
evicts: a full pool is vLLM's store pressure, and a sized trace is refused) is
in tests/test_store_real_master.py.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from conftest import STORE_SCENARIOS, cli, cli_here
from helpers_traces import assert_bad_input, listing
from traces import load_target
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError

PRESSURE = STORE_SCENARIOS / "pressure_evicts_a_prefix_a_resend_needs.yaml"
KEYS_PER_PROMPT = 64                  # 1,024 tokens in blocks of 16
KEY_BYTES = 256


def _outcomes(stdout: str) -> dict[str, dict]:
    return {r["id"]: r for r in json.loads(stdout)["requests"]}


# -- the engine key (no vLLM) ------------------------------------------------
@pytest.mark.parametrize("text, size", [("32KB", 32768), ("1.5mb", 1536 * 1024),
                                        (4096, 4096), ("2GB", 2 << 30)])
def test_the_segment_size_reads_as_people_write_it(text, size):
    engine = EngineBlock.from_dict("s.yaml", {"connector": "mooncake_store",
                                              "mooncake_global_segment_size": text})
    assert engine.mooncake_global_segment_size == size
    assert engine.to_header()["mooncake_global_segment_size"] == text     # as written


@pytest.mark.parametrize("engine, needle", [
    ({"mooncake_global_segment_size": "64MB"},
     "engine.mooncake_global_segment_size needs engine.connector"),
    ({"connector": "mooncake_store", "mooncake_global_segment_size": "lots"},
     "engine.mooncake_global_segment_size 'lots': expected a size such as 64MB or 2GB"),
    ({"connector": "mooncake_store", "mooncake_global_segment_size": 0},
     "expected a size"),
    ({"connector": "mooncake_store", "mooncake_global_segment_size": "2000000GB"},
     "above the limit of 1 PiB"),
])
def test_a_bad_segment_size_is_one_line_naming_the_file(engine, needle, tmp_path):
    with pytest.raises(TraceError, match="s.yaml: .*" + needle.replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        EngineBlock.from_dict("s.yaml", engine)
    src = tmp_path / "s.yaml"
    src.write_text(json.dumps({"engine": engine, "requests": [
        {"id": "a", "prompt": [{"stream": "a", "len": 64}]}]}))
    before = listing(tmp_path)
    assert_bad_input(cli_here("compile", src, "-o", tmp_path / "OUT"), "s.yaml", needle)
    assert listing(tmp_path) == before


# -- replays on the installed vLLM ---------------------------------------------
def test_the_third_prompts_puts_evict_the_first_so_its_resend_misses(tmp_path):
    ops = tmp_path / "ops.parquet"
    proc = cli("run", PRESSURE, "--json", "-", "--store-ops", ops)
    assert proc.returncode == 0, proc.stderr
    got = _outcomes(proc.stdout)
    assert got["a_again"]["num_external_cached_tokens"] == 0
    assert got["c_again"]["num_external_cached_tokens"] == 1008
    rows = pl.read_parquet(ops)
    puts = rows.filter(pl.col("op") == "put")
    assert set(puts["bytes"].to_list()) == {KEY_BYTES}
    evicted = rows.filter(pl.col("op") == "evict")
    # The pool holds two prompts: c's 64 puts push out a's 64 keys, oldest first,
    # then a's resend puts its keys again and pushes out b's.
    a_keys = puts.filter(pl.col("request") == "a")["key"].unique().to_list()
    first = evicted.head(KEYS_PER_PROMPT)
    assert sorted(first["key"].to_list()) == sorted(a_keys)
    c_step = puts.filter(pl.col("request") == "c")["step"].min()
    assert first["step"].unique().to_list() == [c_step]
    # What a_again looked up is what was evicted: the lookup says 0 before any get.
    assert rows.filter((pl.col("op") == "get") & (pl.col("request") == "a")).height == 0


def test_a_pool_large_enough_or_a_second_rank_keeps_the_prefix():
    # --store-capacity overrides the trace's segment: room for every prompt.
    proc = cli("run", PRESSURE, "--json", "-", "--store-capacity", "1MB")
    assert proc.returncode == 0, proc.stderr
    assert _outcomes(proc.stdout)["a_again"]["num_external_cached_tokens"] == 1008
    # At TP 2 each rank mounts a segment: the pool is twice as large, and the
    # replicated attention keys are written once (striped over the ranks).
    proc = cli("run", PRESSURE, "--json", "-", "--set", "engine.tensor_parallel_size=2")
    assert proc.returncode == 0, proc.stderr
    got = _outcomes(proc.stdout)
    assert got["a_again"]["num_external_cached_tokens"] == 1008
    assert got["c_again"]["num_external_cached_tokens"] == 1008


def test_a_recording_carries_the_segment_and_replays_the_same_pressure(tmp_path):
    from replayer.check import recorded
    from replayer.replay.store import StoreSpec

    out = tmp_path / "rec"
    recorded.record_replay(load_target(PRESSURE), out, store=StoreSpec("memory"))
    # Read from the Mooncake config file the store client was given.
    header = json.loads((out / "header.json").read_text())
    assert header["engine"]["mooncake_global_segment_size"] == 32768
    proc = cli("check", "--against", "recorded", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = cli("run", out, "--json", "-")
    assert again.returncode == 0, again.stderr
    assert _outcomes(again.stdout)["a_again"]["num_external_cached_tokens"] == 0
