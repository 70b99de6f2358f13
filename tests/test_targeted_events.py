"""Targeted ``evict`` events, ``store_remove`` of named keys, and ``expect_store.gets``.

Bad input first (scenario and trace directory: one line, exit 2, nothing
written), then what each does on the installed vLLM: the fixtures'
goldens, the same scenario without the event (the hit the event took away),
the ``remove`` op in ``store_ops``, the gets golden in a scenario and in a
trace directory's ``golden/store-vllm-X.parquet``.
"""

from __future__ import annotations

import json
import textwrap

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ruamel.yaml import YAML

from conftest import SCENARIOS, STORE_SCENARIOS, cli, cli_here
from helpers_traces import assert_bad_input, listing, make_trace_dir
from traces.goldens.store import STORE, compare_store, from_report, from_table, to_table

EVICT = SCENARIOS / "evict_request.yaml"
EVICT_GROUP = SCENARIOS / "evict_group_hybrid.yaml"
REMOVE = STORE_SCENARIOS / "store_remove_named_keys.yaml"
RESEND = STORE_SCENARIOS / "resend_after_reset.yaml"

ENGINE = "engine: {block_size: 16%s}\n"
REQS = ("requests:\n  - {id: a, prompt: {stream: s, len: 40}}\n"
        "  - {id: b, after: a, prompt: {stream: s, len: 40}}\n")
STORE_ENGINE = ", connector: mooncake_store"

BAD_EVENTS = {
    "evict_needs_request_or_group": ("", "{after: a, action: evict}",
                                     "events[0]: evict needs request: ID, group: G, or both"),
    "evict_unknown_request": ("", "{after: a, action: evict, request: zz}",
                              "events[0].request names unknown request 'zz'"),
    "evict_negative_group": ("", "{after: a, action: evict, group: -1}",
                             "events[0].group must be an integer >= 0, got -1"),
    "evict_group_not_int": ("", "{after: a, action: evict, group: one}",
                            "events[0].group must be an integer >= 0, got 'one'"),
    "evict_takes_no_target": ("", "{after: a, action: evict, target: a}",
                              "events[0].target does not apply to action evict "
                              "(takes request, group)"),
    "reset_takes_nothing": ("", "{after: a, action: reset_prefix_cache, request: a}",
                            "events[0].request does not apply to action reset_prefix_cache "
                            "(takes nothing more)"),
    "unknown_event_key": ("", "{after: a, action: evict, blocks: 3}",
                          "unknown key 'blocks' in events[0]"),
    "remove_needs_keys": (STORE_ENGINE, "{after: a, action: store_remove}",
                          "events[0].keys must be a non-empty list"),
    "remove_empty_keys": (STORE_ENGINE, "{after: a, action: store_remove, keys: []}",
                          "events[0].keys must be a non-empty list"),
    "remove_key_needs_request": (STORE_ENGINE, "{after: a, action: store_remove, keys: [{group: 1}]}",
                                 "events[0].keys[0] needs request"),
    "remove_key_unknown_request": (STORE_ENGINE,
                                   "{after: a, action: store_remove, keys: [{request: zz}]}",
                                   "events[0].keys[0].request names unknown request 'zz'"),
    "remove_key_unknown_field": (STORE_ENGINE,
                                 "{after: a, action: store_remove, keys: [{request: a, hash: x}]}",
                                 "unknown key 'hash' in events[0].keys[0]"),
    "remove_key_zero_boundary": (STORE_ENGINE, "{after: a, action: store_remove, "
                                               "keys: [{request: a, boundary: 0}]}",
                                 "events[0].keys[0].boundary must be an integer >= 1, got 0"),
    "remove_takes_no_group": (STORE_ENGINE, "{after: a, action: store_remove, group: 1, "
                                            "keys: [{request: a}]}",
                              "events[0].group does not apply to action store_remove"),
    "remove_needs_connector": ("", "{after: a, action: store_remove, keys: [{request: a}]}",
                               "events[0]: store_remove needs engine.connector"),
}


@pytest.mark.parametrize("case", list(BAD_EVENTS))
def test_bad_event_in_a_scenario(tmp_path, case):
    extra, event, needle = BAD_EVENTS[case]
    src = tmp_path / "bad.yaml"
    src.write_text(ENGINE % extra + REQS + f"events:\n  - {event}\n")
    before = listing(tmp_path)
    proc = cli_here("compile", src, "-o", tmp_path / "OUT")
    assert_bad_input(proc, "bad.yaml", needle)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("row, column, needle", [
    ({"action": "evict"}, "target", "evict needs a target request, a group, or both"),
    ({"action": "evict", "target": "zz"}, "target", "evict of unknown request 'zz'"),
    ({"action": "evict", "group": -2}, "group", "evict of group -2 (must be >= 0)"),
    ({"action": "store_remove"}, "keys", "store_remove needs keys"),
    ({"action": "store_remove", "keys": [{"request": "zz", "group": None, "boundary": None}]},
     "keys", "store_remove names unknown request 'zz'"),
])
def test_bad_event_in_a_trace_directory(tmp_path, row, column, needle):
    from traces.model.schema import EVENTS

    trace = make_trace_dir(tmp_path)
    full = {"after": None, "at_step": 0, "target": None, "group": None, "keys": None, **row}
    pq.write_table(pa.Table.from_pylist([full], schema=EVENTS.arrow_schema()),
                   trace / "events.parquet")
    proc = cli_here("info", trace)
    assert_bad_input(proc, "events.parquet", f"column '{column}', row 0", needle)


def run_json(tmp_path, path, *args):
    out = tmp_path / f"{path.stem}.json"
    proc = cli("run", path, "--json", out, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def hits(out) -> dict[str, int]:
    return {r["id"]: r["num_cached_tokens"] for r in out["requests"]}


def without_events(tmp_path, path):
    """The same scenario with no events and no goldens."""
    yaml = YAML()
    data = yaml.load(path.read_text())
    for key in ("events", "expect", "expect_store"):
        data.pop(key, None)
    copy = tmp_path / f"no_events_{path.name}"
    with copy.open("w") as fh:
        yaml.dump(data, fh)
    return copy


def test_evict_of_one_request_loses_exactly_its_hit(tmp_path):
    proc = cli("check", EVICT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hits(run_json(tmp_path, EVICT)) == {"a": 0, "b": 0, "a_again": 0, "b_again": 992}
    # Without the event a's resend hits as b's does: the evict took exactly a's hit.
    assert hits(run_json(tmp_path, without_events(tmp_path, EVICT)))["a_again"] == 992


def test_evict_of_a_requests_group_and_of_a_whole_group(tmp_path):
    proc = cli("check", EVICT_GROUP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hits(run_json(tmp_path, EVICT_GROUP)) == {
        "a": 0, "b": 0, "a_again": 0, "b_again": 4992, "b_late": 0}
    plain = hits(run_json(tmp_path, without_events(tmp_path, EVICT_GROUP)))
    assert plain["a_again"] == 4992 and plain["b_late"] == 4992


@pytest.mark.parametrize("event, needle", [
    ("{at_step: 0, action: evict, request: b}",
     "event evict (at_step 0) at step 0: request 'b' has not arrived yet"),
    ("{after: a, action: evict, group: 3}",
     "event evict (after a) at step 1: group 3: vLLM has 1 KV-cache group(s), numbered from 0"),
    ("{at_step: 0, action: evict, group: 0}",
     "event evict (at_step 0) at step 0: no cached block of group 0 to evict"),
])
def test_evict_that_cannot_run_stops_the_replay_in_one_line(tmp_path, event, needle):
    src = tmp_path / "s.yaml"
    src.write_text(ENGINE % "" + REQS + f"events:\n  - {event}\n")
    out = tmp_path / "out.json"
    proc = cli("run", src, "--json", out)
    assert_bad_input(proc, needle)
    assert not out.exists()


def test_store_remove_misses_the_store_exactly_there(tmp_path):
    proc = cli("check", REMOVE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("store: 25 key(s) written and 4 lookup(s) match the store "
            "goldens for vllm==0.33.0") in proc.stdout
    ops_file = tmp_path / "ops.parquet"
    out = run_json(tmp_path, REMOVE, "--store-ops", ops_file)
    ops = pl.read_parquet(ops_file)
    removed = ops.filter(pl.col("op") == "remove")
    # One attention key of p7449; every Mamba key of p23196 (no boundary named).
    assert removed.select("request", "group", "boundary", "result").rows() == [
        ("p7449", 0, 6144, 0), ("p23196", 1, 21504, 0), ("p23196", 1, 23040, 0)]
    # The key is gone from then on: later exists/gets of it miss or never happen.
    key = removed["key"][0]
    later = ops.filter((pl.col("key") == key) & (pl.col("order") > removed["order"][0]))
    assert later.filter(pl.col("op") == "get").height == 0
    assert out["store"]["ops"]["remove"] == 3
    # Without the removes both resends hit as in resend_after_reset.yaml.
    assert hits(run_json(tmp_path, without_events(tmp_path, REMOVE)))["p7449_again"] == 7296
    assert hits(out)["p7449_again"] == 0 and hits(out)["p23196_again"] == 0


def test_store_remove_of_a_key_never_written_is_one_line(tmp_path):
    src = tmp_path / "s.yaml"
    src.write_text(ENGINE % STORE_ENGINE + REQS
                   + "events:\n  - {after: a, action: store_remove, keys: "
                     "[{request: a, group: 0, boundary: 17}]}\n")
    proc = cli("run", src)
    assert_bad_input(proc, "event store_remove (after a) at step",
                     "store memory: store_remove: no key of request 'a' group 0 @ 17 was written")


def test_a_get_golden_that_differs_is_reported(tmp_path):
    text = RESEND.read_text().replace(
        "p7449_again: {0: [1536, 3072, 4608, 6144, 7424], 1: [7296]}",
        "p7449_again: {0: [1536, 3072, 4608, 6144, 7424], 1: [4608, 7296]}")
    assert text != RESEND.read_text()
    src = tmp_path / RESEND.name
    src.write_text(text)
    proc = cli("check", src)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "missing get: group 1 @ 4608 (p7449_again)" in proc.stdout


def test_gets_golden_in_a_trace_directory(tmp_path):
    trace = tmp_path / "trace"
    assert cli_here("compile", RESEND, "-o", trace).returncode == 0
    for p in (trace / "golden").glob("*"):
        p.unlink()
    proc = cli("check", trace, "--update-golden")
    assert proc.returncode in (0, 1) and "store goldens rewritten" in proc.stdout, proc.stderr
    table = pq.read_table(trace / "golden" / "store-vllm-0.33.0.parquet")
    gets = [r for r in table.to_pylist() if r["kind"] == "get"]
    assert {(r["request"], r["group"], r["boundary"]) for r in gets} >= {
        ("p7449_again", 1, 7296), ("p23196_again", 1, 23040)}
    proc = cli("check", trace)
    assert proc.returncode == 0 and "50 key(s) fetched" in proc.stdout, proc.stdout


def test_gets_round_trip_and_compare():
    rows = [{"op": "put", "result": 0, "request": "a", "group": 0, "boundary": 16},
            {"op": "get", "result": 64, "request": "a", "loader": "b", "group": 0,
             "boundary": 16},
            {"op": "get", "result": -704, "request": "a", "loader": "b", "group": 1,
             "boundary": 16}]
    got = from_report(rows, [{"request": "b", "hit_length": 16}])
    assert got == {"puts": {"a": {0: [16]}}, "gets": {"b": {0: [16]}}, "lookups": {"b": 16}}
    assert from_table(to_table(got, "vllm==0.33.0")) == got
    assert STORE.to_yaml(got)["gets"] == {"b": {0: [16]}}
    want = {"puts": {"a": {0: [16]}}, "gets": {"b": {0: [16, 32]}}, "lookups": {"b": 16}}
    assert [d.describe() for d in compare_store(want, got)] == [
        "missing get: group 0 @ 32 (b)"]
    # A golden without gets does not check them.
    assert compare_store({"puts": {"a": {0: [16]}}, "lookups": {"b": 16}}, got) == []


def test_an_engine_without_evict_says_so():
    from types import SimpleNamespace

    from replayer.replay.engines.base import UnsupportedByEngine
    from replayer.replay.engines.block_evict import BlockEvictor

    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=None),
                                kv_cache_config=SimpleNamespace(kv_cache_groups=[]))
    with pytest.raises(UnsupportedByEngine, match="vllm 9.9: no KVCacheManager.evict_blocks"):
        BlockEvictor(scheduler, "9.9")
