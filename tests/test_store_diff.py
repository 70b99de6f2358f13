"""``diff`` and ``bisect`` compare store keys by meaning (no vLLM: replay results built here).

The store reports are shaped as a replay's (``ReplayResult.store``): rows of
store operations named by request, group and boundary, and lookups. The
values are the #56615 resend of 7449 tokens: before the fix the worker wrote
attention KV at B = 7296 (0.30-0.31), after it at B + H = 7424 (0.32 on).
"""

from __future__ import annotations

import json

import pytest

from replayer.compare.bisection import PREDICATES, probe_line, search
from replayer.compare.outcomes import compare_results, diff_table
from replayer.replay.engines import EngineError, EngineInfo
from replayer.replay.loop import ReplayResult
from replayer.compare.store import MAX_LINES, compare_stores, store_lines
from traces.model.outcome import RequestOutcome


def _put(request: str, group: int, boundary: int, key: str | None = None) -> dict:
    return {"op": "put", "request": request, "group": group, "boundary": boundary,
            "result": 0, "key": key or f"k@group:{group}@{request}-{boundary}"}


def _store(tail: int, hit: int, mamba: tuple[int, ...] = (4608, 7296)) -> dict:
    rows = [_put("p7449", 0, b) for b in (1536, 3072, 4608, 6144, tail)]
    rows += [_put("p7449", 1, b) for b in mamba]
    rows.append({"op": "put", "request": "p7449", "group": 0, "boundary": 9999, "result": -200,
                 "key": "refused"})                   # a failed put is not a key written
    rows.append({"op": "exists", "request": "p7449", "group": 0, "boundary": 1536, "result": 1,
                 "key": "k"})
    lookups = [{"request": "p7449", "num_tokens": 7449, "hit_length": 0, "step": 0},
               {"request": "again", "num_tokens": 7449, "hit_length": hit, "step": 3},
               {"request": "again", "num_tokens": 7449, "hit_length": 0, "step": 4}]
    return {"backend": "memory", "rows": rows, "lookups": lookups, "seconds": 0.0}


def _result(version: str, cached: int, store: dict | None) -> ReplayResult:
    reqs = [RequestOutcome(id="p7449", arrival_step=0, num_prompt_tokens=7449,
                           num_cached_tokens=0, num_local_cached_tokens=0,
                           num_external_cached_tokens=0),
            RequestOutcome(id="again", arrival_step=3, num_prompt_tokens=7449,
                           num_cached_tokens=cached, num_local_cached_tokens=0,
                           num_external_cached_tokens=cached)]
    return ReplayResult(engine=EngineInfo(version, "release"), requests=reqs, steps=6,
                        store=store)


BEFORE = _store(tail=7296, hit=4608)      # 0.31.0: attention at B
AFTER = _store(tail=7424, hit=7296)       # 0.32.0: attention at B + H


def test_keys_on_one_side_are_named_by_request_group_and_boundary():
    d = compare_stores(BEFORE, AFTER)
    assert d is not None and not d.identical
    assert [k.describe() for k in d.only_a] == ["group 0 @ 7296 (p7449)"]
    assert [k.describe() for k in d.only_b] == ["group 0 @ 7424 (p7449)"]
    # The first lookup of a request decides its hit; the later one is not compared.
    assert [x.describe() for x in d.lookup_diffs] == ["lookup of again: hit_length A 4608, B 7296"]
    assert (d.keys, d.lookups) == (7, 2)
    assert store_lines(d) == [
        "store: 1 key(s) only on A, 1 only on B, 1 lookup(s) differ",
        "  only on A: group 0 @ 7296 (p7449)",
        "  only on B: group 0 @ 7424 (p7449)",
        "  lookup of again: hit_length A 4608, B 7296"]


def test_hashes_do_not_matter_only_meaning():
    """Another hash seed or release names the same key with another hash: no difference."""
    rehashed = _store(tail=7296, hit=4608)
    for row in rehashed["rows"]:
        row["key"] = "other-" + row["key"]
    d = compare_stores(BEFORE, rehashed)
    assert d is not None and d.identical
    assert store_lines(d) == ["store: the same 7 key(s) and 2 lookup(s) on A and B"]


def test_no_connector_no_store_part():
    assert compare_stores(None, None) is None
    d = compare_results(_result("0.29.0", 0, None), _result("0.30.0", 0, None))
    assert d.store is None and d.identical
    assert "store" not in d.as_dict()
    assert "store:" not in diff_table(d)


def test_one_side_without_a_report_shows_everything_on_the_other():
    d = compare_stores(None, AFTER)
    assert d is not None and len(d.only_b) == 7 and not d.only_a
    assert [x.describe() for x in d.lookup_diffs] == [
        "lookup of p7449: hit_length A none, B 0", "lookup of again: hit_length A none, B 7296"]


def test_long_lists_are_cut_in_the_table_not_in_json():
    many = {"backend": "memory", "lookups": [],
            "rows": [_put("r", 0, 128 * (i + 1)) for i in range(MAX_LINES + 5)]}
    d = compare_stores(many, {"backend": "memory", "rows": [], "lookups": []})
    assert d is not None
    lines = store_lines(d)
    assert len(lines) == 1 + MAX_LINES + 1
    assert lines[-1] == "  ... and 5 more (--json has them all)"
    assert len(d.as_dict()["only_a"]) == MAX_LINES + 5


def test_diff_reports_store_differences_even_when_outcomes_agree():
    same_hits = _store(tail=7424, hit=4608)
    d = compare_results(_result("0.31.0", 4608, BEFORE), _result("0.32.0", 4608, same_hits))
    assert d.outcomes_identical and not d.store_identical and not d.identical
    table = diff_table(d).splitlines()
    assert table[2] == "identical: 2 requests, the same outcome on A and B"
    assert table[3:] == ["store: 1 key(s) only on A, 1 only on B, 0 lookup(s) differ",
                         "  only on A: group 0 @ 7296 (p7449)",
                         "  only on B: group 0 @ 7424 (p7449)"]
    out = json.loads(json.dumps(d.as_dict()))
    assert out["identical"] is False
    assert out["store"] == {"identical": False,
                            "only_a": [{"request": "p7449", "group": 0, "boundary": 7296}],
                            "only_b": [{"request": "p7449", "group": 0, "boundary": 7424}],
                            "lookups": []}


def test_diff_table_with_store_and_outcome_changes():
    d = compare_results(_result("0.31.0", 4608, BEFORE), _result("0.32.0", 7296, AFTER))
    lines = diff_table(d).splitlines()
    assert lines[0].split() == ["request", "A", "cached", "B", "cached", "delta"]
    assert lines[1].split()[:4] == ["again", "4608", "7296", "+2688"]
    assert "2 requests: 1 gained, 0 lost, 1 unchanged; tokens gained on B: +2688" in lines
    assert lines[-1] == "  lookup of again: hit_length A 4608, B 7296"


# --- bisect: a predicate over store keys and lookups ------------------------------------


def _line(store_changes_at: int, hits_change_at: int):
    """Engines 0..8; the store layout changes at one index, the hits at another."""
    def replay_one(i: int) -> ReplayResult:
        store = AFTER if i >= store_changes_at else BEFORE
        return _result(f"0.{i}.0", 7296 if i >= hits_change_at else 4608, store)
    return replay_one


def test_bisect_on_store_finds_the_first_engine_whose_keys_differ():
    # Keys change at 3 (say, a refactor that moves a put), hits only at 6.
    res = search(list(range(9)), _line(3, 6), on="store")
    assert res.first_bad is not None and res.first_bad.index == 3
    assert res.change is not None and res.change.outcomes_identical
    assert [k.describe() for k in res.change.store.only_b] == ["group 0 @ 7424 (p7449)"]
    res = search(list(range(9)), _line(3, 6), on="outcomes")
    assert res.first_bad is not None and res.first_bad.index == 6
    res = search(list(range(9)), _line(3, 6), on="any")
    assert res.first_bad is not None and res.first_bad.index == 3


def test_bisect_on_store_when_only_hits_change_finds_nothing():
    res = search(list(range(5)), _line(99, 2), on="store")
    assert res.first_bad is None and [p.index for p in res.path] == [0, 4]


def test_probe_lines_say_the_keys_written_with_a_connector():
    res = search([0, 1], _line(1, 1), on="any")
    assert [probe_line(p) for p in res.path] == [
        "  good  vllm 0.0.0 (release)  cached 4608  keys 7  the reference",
        "  bad   vllm 0.1.0 (release)  cached 7296  keys 7  differs from good"]
    res = search([0, 1], lambda i: _result(f"0.{i}.0", 64 * i, None))
    assert probe_line(res.path[1]) == "  bad   vllm 0.1.0 (release)  cached 64  differs from good"


def test_bisect_refuses_an_unknown_predicate():
    assert sorted(PREDICATES) == ["any", "outcomes", "store"]
    with pytest.raises(EngineError, match="bisect --on keys: not one of any, outcomes, store"):
        search([0, 1], _line(1, 1), on="keys")


def test_bisect_on_store_refuses_a_trace_without_a_connector():
    from conftest import SCENARIOS, cli

    target = SCENARIOS / "vllm51295_turn1_24577.yaml"
    proc = cli("bisect", target, "--on", "store", "--good", "vllm==0.29.0",
               "--bad", "vllm==0.33.0")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        f"replayer: error: {target}: bisect --on store needs a trace with a connector "
        "(engine.connector)"]
