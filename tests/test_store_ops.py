"""The store_ops table a connector replay writes (memory store; no master needed)."""

from __future__ import annotations

import json

import polars as pl

from conftest import cli


def test_store_ops_table_holds_every_operation_in_order(tmp_path):
    ops_file, json_file = tmp_path / "ops.parquet", tmp_path / "out.json"
    proc = cli("run", "fixtures/store/vllm51295_reset_before_turn2.yaml",
               "--store-ops", str(ops_file), "--json", str(json_file))
    assert proc.returncode == 0, proc.stderr
    ops = pl.read_parquet(ops_file)
    out = json.loads(json_file.read_text())
    assert ops["order"].to_list() == list(range(ops.height))
    assert ops["step"].to_list() == sorted(ops["step"].to_list())
    assert set(ops["op"].unique().to_list()) >= {"lookup", "exists", "put", "get"}
    puts = ops.filter((pl.col("op") == "put") & (pl.col("result") >= 0))
    assert puts["key"].to_list() == out["store"]["puts"]
    assert puts["group"].null_count() == 0 and puts["boundary"].null_count() == 0
    assert set(puts["request"].to_list()) == {"turn1", "turn2"}
    # turn 2's hit came back from the store: its gets read real bytes.
    gets = ops.filter((pl.col("op") == "get") & (pl.col("result") > 0))
    assert gets.height > 0 and (gets["bytes"] > 0).all()
    assert out["requests"][1]["num_external_cached_tokens"] == 24448
    assert {k: v for k, v in out["store"]["ops"].items()} == {
        op: ops.filter(pl.col("op") == op).height for op in out["store"]["ops"]}


def test_store_ops_needs_a_connector(tmp_path):
    proc = cli("run", "fixtures/scenarios/reset_prefix_cache.yaml",
               "--store-ops", str(tmp_path / "ops.parquet"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--store-ops needs a trace with engine.connector" in lines[0]
    assert not (tmp_path / "ops.parquet").exists()
