"""The store_ops table a connector replay writes (memory store; no master needed)."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import polars as pl

from conftest import FIXTURES, STORE_SCENARIOS, cli

from traces import read_trace
from traces.io.parts import RECORDED_COLUMNS


def test_store_ops_table_holds_every_operation_in_order(tmp_path):
    ops_file, json_file = tmp_path / "ops.parquet", tmp_path / "out.json"
    own_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))     # short: the session's dir goes here
    proc = cli("run", "fixtures/store/vllm51295_reset_before_turn2.yaml",
               "--store-ops", str(ops_file), "--json", str(json_file), env={"TMPDIR": own_tmp})
    assert proc.returncode == 0, proc.stderr
    # The store session's directory (client config, log, lookup socket) is gone
    # (torch's own compile cache may stay there).
    left = sorted(p.name for p in own_tmp.iterdir())
    shutil.rmtree(own_tmp)
    assert [n for n in left if n.startswith("replayer-")] == []
    ops = pl.read_parquet(ops_file)
    out = json.loads(json_file.read_text())
    assert ops["order"].to_list() == list(range(ops.height))
    assert ops["instance"].null_count() == ops.height      # one engine, not a pair
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


def test_store_ops_without_the_instance_column_still_read():
    # A recording holds one engine: no instance column, as no table written before
    # the column has; it reads.
    trace = read_trace(FIXTURES / "traces" / "live_store_llama")
    assert trace.store_ops.num_rows > 0 and "instance" not in trace.store_ops.column_names
    assert "instance" not in RECORDED_COLUMNS["store_ops"]


def test_a_deep_tmpdir_keeps_the_lookup_socket_path_short(tmp_path, monkeypatch):
    """vLLM's lookup socket lives in the session's directory; a Unix socket path
    holds at most 107 bytes, so under a deep TMPDIR the directory goes to /tmp.
    Gone at close either way."""
    from replayer.replay.engines.connector.mooncake_session import StoreSession
    from replayer.replay.store import StoreSpec

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    session = StoreSession(StoreSpec("memory"))
    try:
        name = f"lookup_rpc_port_0_host_{socket.gethostname()}_dp_rank0"
        assert len(f"{session.tmp}/{name}") <= 107
        assert (session.tmp / "mooncake.json").exists()
    finally:
        session.close()
    assert not session.tmp.exists()


def test_puts_made_while_decoding_name_their_request_and_boundary(tmp_path):
    """fixtures/store/decode_puts_named.yaml (save_decode_cache): the blocks ending
    at 48, 64 and 80 are filled by talk's output tokens, after its prompt was
    preprocessed; their puts are filed under talk at their token boundaries, not
    under null, and quote's gets of them are named the same way."""
    ops_file = tmp_path / "ops.parquet"
    proc = cli("run", "fixtures/store/decode_puts_named.yaml", "--store-ops", str(ops_file))
    assert proc.returncode == 0, proc.stderr
    ops = pl.read_parquet(ops_file)
    puts = ops.filter((pl.col("op") == "put") & (pl.col("result") >= 0))
    decode = puts.filter(pl.col("step") > 0)          # talk's prefill is step 0
    assert decode["boundary"].to_list() == [48, 64, 80]
    assert decode["request"].to_list() == ["talk"] * 3
    assert len(set(decode["step"].to_list())) == 3     # one put per filled block, as it fills
    gets = ops.filter((pl.col("op") == "get") & (pl.col("result") > 0))
    assert gets["boundary"].to_list() == [16, 32, 48, 64, 80]
    assert set(gets["request"].to_list()) == {"talk"} and set(gets["loader"]) == {"quote"}


def test_a_pd_pair_decodes_what_its_prefill_instance_wrote(tmp_path):
    """fixtures/store/pd_pair_shared_store.yaml (engine.prefill_instance): the
    kv_producer prefill instance writes, the kv_consumer decode instance reads
    the same store. The decode side's hit is its lookup's, from keys put before
    any get of them; with a prefill instance that writes nothing (kv_consumer
    too) the decode side gets nothing from the store."""
    fixture = STORE_SCENARIOS / "pd_pair_shared_store.yaml"
    ops_file, json_file = tmp_path / "ops.parquet", tmp_path / "out.json"
    proc = cli("run", fixture, "--store-ops", ops_file, "--json", json_file)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(json_file.read_text())
    turn1, turn2 = out["requests"]
    assert (turn1["num_external_cached_tokens"], turn1["num_local_cached_tokens"]) == (7296, 0)
    assert turn2["num_local_cached_tokens"] > 0 and turn2["num_external_cached_tokens"] > 0
    # One lookup filed per request: the decode instance's, whose hit it took.
    assert [(x["request"], x["hit_length"]) for x in out["store"]["lookups"]] == [
        ("turn1", 7296), ("turn2", turn2["num_cached_tokens"])]
    ops = pl.read_parquet(ops_file)
    puts = ops.filter((pl.col("op") == "put") & (pl.col("result") >= 0))
    gets = ops.filter((pl.col("op") == "get") & (pl.col("result") > 0))
    first_put = dict(zip(puts["key"].to_list(), puts["order"].to_list()))
    assert gets.height > 0
    assert all(first_put.get(k, 1 << 62) < o for k, o in zip(gets["key"], gets["order"]))
    # Each row names the instance whose store client made it: the producer puts, the
    # consumer loads; both look up (an evict, the shared pool's own, would be null).
    assert set(puts["instance"]) == {"prefill"} and set(gets["instance"]) == {"decode"}
    assert ops["instance"].null_count() == 0
    assert set(ops.filter(pl.col("op") == "lookup")["instance"]) == {"prefill", "decode"}
    # The prefill instance as a consumer too: nothing is written, nothing read.
    silent = tmp_path / "silent.yaml"
    silent.write_text(fixture.read_text().replace("kv_role: kv_producer",
                                                  "kv_role: kv_consumer"))
    proc = cli("run", silent, "--json", json_file)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(json_file.read_text())
    assert [r["num_external_cached_tokens"] for r in out["requests"]] == [0, 0]
    assert out["store"]["puts"] == [] and out["store"]["ops"].get("get", 0) == 0
