"""The store as deployed: one real store worker per TP/DCP rank, per-rank goldens
and diffs, one rank's shard lost, and store faults through vLLM's error handling.

Unit tests of the golden and diff logic first (no vLLM), then replays on the
installed vLLM through the CLI: the fixtures in ``fixtures/store/`` named
``*tp2*`` / ``*dcp2*`` hold the goldens per release (the plugin phase checks
them on every release); these tests check what the goldens cannot say: which
rank wrote which key, what the same scenario gives without the event, a
recording at TP 2 compared rank by rank, and the bad input.
"""

from __future__ import annotations

import json
import re

import polars as pl
import pytest
import yaml
from ruamel.yaml import YAML

from conftest import STORE_SCENARIOS, cli, cli_here
from helpers_traces import assert_bad_input, listing
from traces.goldens.store import STORE, compare_store, from_report, from_table, to_table

TP2 = STORE_SCENARIOS / "resend_after_reset_tp2.yaml"
DCP2 = STORE_SCENARIOS / "resend_after_reset_dcp2.yaml"
TP1 = STORE_SCENARIOS / "resend_after_reset.yaml"
LOST = STORE_SCENARIOS / "tp2_one_rank_lost_mamba.yaml"
PUT_FAILS = STORE_SCENARIOS / "tp2_put_fails_at_b_plus_h.yaml"
GET_FAILS = STORE_SCENARIOS / "tp2_get_fails_request_errors.yaml"


def _put(rank: int, request: str, group: int, boundary: int, order: int = 0) -> dict:
    return {"order": order, "step": 0, "rank": rank, "op": "put", "key": f"k{order}",
            "group": group, "boundary": boundary, "bytes": 1, "result": 0,
            "request": request, "loader": None}


# -- goldens and diffs by rank (no vLLM) -------------------------------------
def test_a_golden_names_each_ranks_own_keys_and_a_lost_shard_reads_on_its_rank():
    rows = [_put(0, "a", 1, 7296, 0), _put(1, "a", 1, 7296, 1), _put(0, "a", 0, 7424, 2)]
    got = from_report(rows, [{"request": "a", "hit_length": 0}])
    assert got["puts"] == {"a": {0: [7424], 1: [7296]}}            # every rank's, by meaning
    assert got["ranks"] == {0: {"puts": {"a": {0: [7424], 1: [7296]}}},
                            1: {"puts": {"a": {1: [7296]}}}}
    # Rank 1 loses its shard: the union is unchanged, rank 1's own block is not.
    lost = from_report(rows[:1] + rows[2:], [{"request": "a", "hit_length": 0}])
    assert lost["puts"] == got["puts"]
    assert [m.describe() for m in compare_store(got, lost)] == [
        "missing put: group 1 @ 7296 (a) on rank 1"]
    # One rank only: no ranks block, as before ranks existed.
    assert "ranks" not in from_report(rows[:1], [])


def test_rank_goldens_survive_the_table_and_yaml_forms():
    rows = [_put(0, "a", 1, 7296, 0), _put(1, "a", 0, 3072, 1)]
    got = from_report(rows, [{"request": "a", "hit_length": 7296}])
    table = to_table(got, "vllm==0.33.0")
    assert "rank" in table.column_names
    assert from_table(table) == got
    assert compare_store(got, from_table(table)) == []
    one_rank = to_table(from_report(rows[:1], []), "vllm==0.33.0")
    assert "rank" not in one_rank.column_names            # a one-rank table reads as before
    body = yaml.safe_load(yaml.safe_dump(STORE.to_yaml(got)))
    assert STORE.parse_body(TP2, "expect_store", body, {"a"}) == got


def test_subset_match_and_never_looked_up():
    rows = [_put(0, "a", 1, 7296, 0), _put(0, "a", 0, 7424, 1)]
    got = from_report(rows, [{"request": "a", "hit_length": 0}])
    subset = STORE.parse_body(TP2, "x", {"match": "subset", "puts": {"a": {1: [7296]}},
                                         "lookups": {"a": 0}}, {"a", "b"})
    assert compare_store(subset, got) == []                 # 7424 is there, and not listed
    whole = {**subset, "match": "all"}
    assert [m.describe() for m in compare_store(whole, got)] == [
        "extra put: group 0 @ 7424 (a)"]
    missing = STORE.parse_body(TP2, "x", {"match": "subset", "puts": {"a": {1: [4608]}}},
                               {"a"})
    assert [m.describe() for m in compare_store(missing, got)] == [
        "missing put: group 1 @ 4608 (a)"]
    never = STORE.parse_body(TP2, "x", {"lookups": {"a": None, "b": None}}, {"a", "b"})
    assert [m.describe() for m in compare_store(never, got)] == [
        "lookup of a: hit_length expected no lookup, got 0"]


@pytest.mark.parametrize("body, needle", [
    ({"match": "some"}, "x.match must be one of all, subset, got 'some'"),
    ({"ranks": [1]}, "x.ranks must map rank -> {puts: ..., gets: ...}"),
    ({"ranks": {-1: {"puts": {}}}}, "x.ranks rank must be an integer >= 0, got -1"),
    ({"ranks": {0: {"lookups": {}}}}, "unknown key 'lookups' in x.ranks.0"),
    ({"ranks": {0: {"puts": {"zz": {0: [16]}}}}}, "x.ranks.0.puts names unknown request 'zz'"),
])
def test_bad_rank_goldens(body, needle):
    from traces import TraceError

    with pytest.raises(TraceError) as err:
        STORE.parse_body(TP2, "x", body, {"a"})
    assert needle in str(err.value)


def test_store_diff_compares_rank_by_rank():
    from replayer.compare.store import compare_stores, store_lines

    a = {"backend": "memory", "lookups": [],
         "rows": [_put(0, "a", 1, 7296, 0), _put(1, "a", 1, 7296, 1)]}
    b = {"backend": "memory", "lookups": [],
         "rows": [_put(0, "a", 1, 7296, 0), _put(0, "a", 1, 7296, 1)]}
    d = compare_stores(a, b)
    assert [k.describe() for k in d.only_a] == ["group 1 @ 7296 (a) on rank 1"]
    assert d.only_b == []
    assert store_lines(d)[1] == "  only on A: group 1 @ 7296 (a) on rank 1"
    assert d.as_dict()["only_a"] == [{"request": "a", "group": 1, "boundary": 7296, "rank": 1}]
    assert compare_stores(a, a).identical


# -- replays on the installed vLLM -------------------------------------------
def _run(tmp_path, scenario, name: str, *args: str) -> tuple[dict, pl.DataFrame]:
    out, ops = tmp_path / f"{name}.json", tmp_path / f"{name}.ops.parquet"
    proc = cli("run", scenario, "--json", out, "--store-ops", ops, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), pl.read_parquet(ops)


def _hits(out: dict) -> dict[str, int | None]:
    return {r["id"]: r["num_cached_tokens"] for r in out["requests"]}


def _edited(tmp_path, scenario, name: str, edit) -> str:
    yaml = YAML()
    data = yaml.load(scenario.read_text())
    for key in ("expect", "expect_store"):
        data.pop(key, None)
    edit(data)
    path = tmp_path / name
    with path.open("w") as fh:
        yaml.dump(data, fh)
    return path


def test_each_rank_writes_its_own_keys_and_the_hits_are_one_ranks(tmp_path):
    tp1, _ = _run(tmp_path, TP1, "tp1")
    tp2, ops = _run(tmp_path, TP2, "tp2")
    assert _hits(tp2) == {k: v for k, v in _hits(tp1).items() if k in _hits(tp2)}
    assert _hits(tp2)["p23196_again"] == 23040
    puts = ops.filter(pl.col("op") == "put")
    assert set(puts["rank"]) == {0, 1}
    for rank, key in puts.filter(pl.col("group") == 1).select("rank", "key").rows():
        assert f"@tp_rank:{rank}@" in key             # Mamba state: each rank its own shard
    # The attention group of this one-KV-head model is replicated: both ranks write
    # keys of shard 0, striped between them (each key once).
    attention = puts.filter(pl.col("group") == 0)
    assert all("@tp_rank:0@" in k for k in attention["key"])
    assert set(attention["rank"]) == {0, 1}
    assert attention["key"].n_unique() == attention.height
    # Lookups run on rank 0 (vLLM's lookup server) and check every rank's shard.
    lookups = ops.filter(pl.col("op") == "lookup")
    assert set(lookups["rank"]) == {0}
    assert any("@tp_rank:1@" in k for k in lookups["key"])


def test_at_tp4_the_8_head_twin_splits_its_kv_heads_so_each_rank_writes_its_own_keys(tmp_path):
    tp1, _ = _run(tmp_path, TP1, "tp1")
    tp4, ops = _run(tmp_path, TP1, "tp4", "--set", "engine.tensor_parallel_size=4")
    assert _hits(tp4) == _hits(tp1)
    puts = ops.filter(pl.col("op") == "put")
    assert set(puts["rank"]) == {0, 1, 2, 3}
    for rank, key in puts.select("rank", "key").rows():
        assert key.startswith("tiny-llama-tp8@") and f"@tp_rank:{rank}@" in key
    # Every group, every rank, the same boundaries: one shard each.
    for group in (0, 1):
        of_group = puts.filter(pl.col("group") == group)
        per_rank = [sorted(of_group.filter(pl.col("rank") == r)["boundary"].to_list())
                    for r in range(4)]
        assert per_rank[0] and per_rank == [per_rank[0]] * 4


def test_dcp_ranks_each_hold_their_share_of_every_group(tmp_path):
    tp2, _ = _run(tmp_path, TP2, "tp2")
    dcp, ops = _run(tmp_path, DCP2, "dcp2")
    assert _hits(dcp) == _hits(tp2)
    puts = ops.filter(pl.col("op") == "put")
    for rank, key in puts.select("rank", "key").rows():
        assert f"@tp_rank:{rank}@" in key and f"@dcp{rank}@" in key
    for group in (0, 1):
        assert set(puts.filter(pl.col("group") == group)["rank"]) == {0, 1}


def test_one_ranks_lost_shard_loses_the_hit_whichever_rank(tmp_path):
    proc = cli("check", LOST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, ops = _run(tmp_path, LOST, "lost")
    assert _hits(got) == {"a": 0, "a_again": 0, "b": 0, "b_again": 7296}
    removed = ops.filter(pl.col("op") == "remove")
    assert set(removed["rank"]) == {1} and set(removed["group"]) == {1}
    assert all("@tp_rank:1@" in k for k in removed["key"])

    def other_rank(data):
        data["events"][1]["keys"][0]["rank"] = 0

    got0, _ = _run(tmp_path, _edited(tmp_path, LOST, "rank0.yaml", other_rank), "rank0")
    assert _hits(got0)["a_again"] == 0

    def no_remove(data):
        del data["events"][1]

    kept, _ = _run(tmp_path, _edited(tmp_path, LOST, "kept.yaml", no_remove), "kept")
    assert _hits(kept)["a_again"] == 7296        # every shard there: the hit comes back


def test_evictions_of_the_shared_store_are_recorded_once_under_rank_0(tmp_path):
    _, ops = _run(tmp_path, LOST, "small", "--store-capacity", "512KB")   # x 2 ranks
    evicted = ops.filter(pl.col("op") == "evict")
    assert evicted.height > 0
    assert set(evicted["rank"]) == {0}
    assert evicted["key"].n_unique() == evicted.height     # each eviction once, not per rank


def test_a_failed_put_is_recorded_with_its_code_and_the_replay_goes_on(tmp_path):
    got, ops = _run(tmp_path, PUT_FAILS, "put")
    failed = ops.filter(pl.col("result") < 0)
    assert failed.select("op", "rank", "group", "boundary", "request", "result").rows() == [
        ("put", 0, 0, 7424, "a", -200)]
    assert _hits(got) == {"a": 0, "a_again": 4608, "b": 0, "b_again": 7296}

    def never_fires(data):
        data["events"][0]["keys"][0]["boundary"] = 99999

    path = _edited(tmp_path, PUT_FAILS, "never.yaml", never_fires)
    proc = cli("run", path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"store_fault put \(a group 0 @ 99999 rank 0\) armed before step 0 "
                     r"fired 0 of 1 time\(s\)", proc.stderr), proc.stderr


def test_a_failed_load_ends_the_request_or_is_retried_by_policy(tmp_path):
    got, ops = _run(tmp_path, GET_FAILS, "fail")
    assert _hits(got)["a_again"] is None                 # kv_load_failure_policy: fail
    assert ops.filter(pl.col("result") < 0).select("op", "rank", "result").rows() == [
        ("get", 1, -900)]
    finish = {}
    for times in (1, 2):
        def recompute(data, times=times):
            data["engine"]["kv_load_failure_policy"] = "recompute"
            data["events"][1]["times"] = times

        path = _edited(tmp_path, GET_FAILS, f"recompute{times}.yaml", recompute)
        out, ops = _run(tmp_path, path, f"recompute{times}")
        assert _hits(out)["a_again"] == 7296                  # served by the retried load
        assert ops.filter(pl.col("result") < 0).height == times
        finish[times] = next(r["finish_step"] for r in out["requests"] if r["id"] == "a_again")
    assert finish[2] == finish[1] + 1                         # one more retry, one step later


def test_a_recording_at_tp2_compares_rank_by_rank(tmp_path):
    import pyarrow.parquet as pq

    from replayer.check import recorded as fidelity
    from replayer.replay.store import StoreSpec
    from traces import load_target
    from traces.trace import read_trace

    rec = tmp_path / "rec"
    fidelity.record_replay(load_target(LOST), rec, store=StoreSpec("memory"))
    trace = read_trace(rec)
    assert trace.engine.tensor_parallel_size == 2
    assert set(trace.store_ops["rank"].to_pylist()) == {0, 1}
    lines, ok, _ = fidelity.check_against_recorded(trace, store=StoreSpec("memory"))
    assert ok, lines
    # One put filed under the other rank: the same key, another rank's op.
    part = next((rec / "store_ops").glob("part-r001-*.parquet"))
    table = pq.read_table(part)
    ranks = table["rank"].to_pylist()
    i = table["op"].to_pylist().index("put")
    ranks[i] = 0
    pq.write_table(table.set_column(table.column_names.index("rank"), "rank",
                                    __import__("pyarrow").array(ranks, "int64")), part)
    lines, ok, _ = fidelity.check_against_recorded(read_trace(rec), store=StoreSpec("memory"))
    assert not ok
    assert any("on rank 1 not in the recording" in x for x in lines), lines
    assert any("on rank 0 not in the replay" in x for x in lines), lines


ENGINE = "engine: {block_size: 16, connector: mooncake_store, tensor_parallel_size: 2}\n"
REQS = ("requests:\n  - {id: a, prompt: {stream: s, len: 40}}\n"
        "  - {id: b, after: a, prompt: {stream: s, len: 40}}\n")


@pytest.mark.parametrize("event, needle", [
    ("{after: a, action: store_fault, keys: [{request: a}]}",
     "events[0].op must be one of put, get, exists, lookup, got None"),
    ("{after: a, action: store_fault, op: put, code: 5, keys: [{request: a}]}",
     "events[0].code must be a Mooncake error code (a name such as RPC_FAIL or a number "
     "below 0), got 5"),
    ("{after: a, action: store_fault, op: put, code: NOT_A_CODE, keys: [{request: a}]}",
     "got 'NOT_A_CODE'"),
    ("{after: a, action: store_fault, op: put, times: 0, keys: [{request: a}]}",
     "events[0].times must be an integer >= 1, got 0"),
    ("{after: a, action: store_fault, op: put}", "events[0].keys must be a non-empty list"),
    ("{after: a, action: store_fault, op: get, keys: [{request: a, rank: 2}]}",
     "events[0].keys[0].rank 2 is not a rank of this engine (tensor_parallel_size 2)"),
    ("{after: a, action: store_remove, keys: [{request: a, rank: -1}]}",
     "events[0].keys[0].rank must be an integer >= 0, got -1"),
    ("{after: a, action: reset_prefix_cache, op: put}",
     "events[0].op does not apply to action reset_prefix_cache"),
])
def test_bad_store_events(tmp_path, event, needle):
    _refused(tmp_path, ENGINE + REQS + f"events:\n  - {event}\n", needle)


def test_a_fault_needs_a_connector(tmp_path):
    event = "{after: a, action: store_fault, op: put, keys: [{request: a}]}"
    _refused(tmp_path, "engine: {block_size: 16}\n" + REQS + f"events:\n  - {event}\n",
             "events[0]: store_fault needs engine.connector")


@pytest.mark.parametrize("engine, needle", [
    ("{block_size: 16, connector: mooncake_store, kv_load_failure_policy: retry}",
     "engine.kv_load_failure_policy must be one of fail, recompute, got 'retry'"),
    ("{block_size: 16, kv_load_failure_policy: recompute}",
     "engine.kv_load_failure_policy needs engine.connector"),
])
def test_bad_load_failure_policy(tmp_path, engine, needle):
    _refused(tmp_path, f"engine: {engine}\n" + REQS, needle)


def _refused(tmp_path, text: str, needle: str) -> None:
    """``compile`` of this scenario: one line naming the file and ``needle``, exit 2,
    nothing written."""
    src = tmp_path / "bad.yaml"
    src.write_text(text)
    before = listing(tmp_path)
    assert_bad_input(cli_here("compile", src, "-o", tmp_path / "OUT"), "bad.yaml", needle)
    assert listing(tmp_path) == before


FAULT_KEYS = [{"request": "a", "group": None, "boundary": None, "rank": None}]


@pytest.mark.parametrize("row, column, needle", [
    ({"op": "write", "code": -900, "times": 1}, "op",
     "store_fault op must be one of put, get, exists, lookup, got 'write'"),
    ({"op": "put", "code": 5, "times": 1}, "code", "store_fault code must be below 0, got 5"),
    ({"op": "put", "code": -900, "times": 0}, "times",
     "store_fault times must be 1 or more, got 0"),
    ({"op": "put", "code": -900, "times": 1, "keys": None}, "keys", "store_fault needs keys"),
])
def test_bad_store_fault_in_a_trace_directory(tmp_path, row, column, needle):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers_traces import make_trace_dir
    from traces.model.schema import EVENTS

    trace = make_trace_dir(tmp_path)
    full = {"after": None, "at_step": 0, "action": "store_fault", "target": None,
            "group": None, "keys": FAULT_KEYS, **row}
    pq.write_table(pa.Table.from_pylist([full], schema=EVENTS.arrow_schema()),
                   trace / "events.parquet")
    assert_bad_input(cli_here("info", trace), "events.parquet", f"column '{column}', row 0",
                     needle)


def test_a_fault_on_a_rank_the_trace_does_not_run_stops_the_replay(tmp_path):
    """A trace directory skips the scenario's rank check; the replay refuses instead."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers_traces import make_trace_dir
    from traces.model.schema import EVENTS

    trace = make_trace_dir(tmp_path, scenario=ENGINE.replace(", tensor_parallel_size: 2", "")
                           + REQS)
    keys = [{**FAULT_KEYS[0], "rank": 1}]
    row = {"after": "a", "at_step": None, "action": "store_fault", "target": None,
           "group": None, "keys": keys, "op": "get", "code": -900, "times": 1}
    pq.write_table(pa.Table.from_pylist([row], schema=EVENTS.arrow_schema()),
                   trace / "events.parquet")
    assert_bad_input(cli("run", trace), "event store_fault (after a)",
                     "store_fault on rank 1, but the replay runs 1 rank(s) "
                     "(engine.tensor_parallel_size)")


def test_a_store_fault_naming_no_rank_is_refused_where_the_ranks_run_at_once():
    # The model worker at TP N runs its ranks in processes of their own, at once
    # (replayer/replay/engines/worker/ranks.py): which rank would meet a fault that
    # names none first is not fixed, so it is refused; one naming a rank is armed.
    from replayer.replay.engines.connector.mooncake_session import StoreSession
    from replayer.replay.store import StoreError, StoreSpec

    session = StoreSession(StoreSpec("memory"))
    try:
        session.concurrent_ranks = True
        from types import SimpleNamespace

        rank = SimpleNamespace(worker=SimpleNamespace(kv_send_thread=None))
        session.ranks = [rank, rank]
        with pytest.raises(StoreError, match="names no rank.*2 ranks run at once"):
            session.arm_fault("put", (("a", 0, None, None),), -900, 1, 3)
        session.arm_fault("put", (("a", 0, None, 1),), -900, 1, 3)
        assert [f.selectors for f in session.ops.faults] == [(("a", 0, None, 1),)]
    finally:
        session.ranks = []
        session.close()
