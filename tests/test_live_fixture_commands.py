"""Every command that takes a trace, on every committed live recording.

The live fixtures (fixtures/traces/live_*) are traces recorded from a real
server: their requests store the sampled ``output_tokens``, which compiled
scenarios never do. ``explain`` and ``report`` once failed on every one of
them (the reachable-hits computation asked the token source for one output
token fewer than the trace stores). So each command runs on each recording
here, through the CLI, and what the commands print is checked against each
other: explain's actual hits are run's, the sweep's point at the trace's own
geometry is explain's, the what-if run is the sweep's other point, the report
states explain's totals, the anonymised trace replays to the same hits.

Each CLI call starts an interpreter that imports vLLM (~12 s, unless a warm
server runs), so one test per recording runs its commands once, the
independent ones side by side, and checks them together (one test, not one
per command sharing a module-scoped fixture: under pytest-xdist, as
scripts/run-tests.sh runs this file, such a fixture would run again in each
worker); ``check --against recorded`` takes all seven recordings in one call,
in one test.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO, TRACES, cli

from traces import load_target
from traces.reachable import reachable_hits, trace_clock
from traces.trace import read_trace

LIVE = {path.name: path for path in sorted(TRACES.glob("live_*"))}

# A KV cache small enough to change each replay (fewer hits, or more steps
# for eagle, whose hits are one shared block and whose engine needs 129
# blocks for one 4096-token request): the what-if run and the sweep's second point.
# The store recordings (live_store_*) at the smallest pool their engine accepts: the
# MooncakeStore backs every block, and these six requests run one after another,
# so the replay must come out the same (asserted).
WHAT_IF_BLOCKS = {"live_llama": 1500, "live_eagle": 150,
                  "live_qwen3_next": 48, "live_qwen3_next_kv_events": 48,
                  "live_store_eagle": 129, "live_store_llama": 129, "live_store_qwen3_next": 15}
STORE_BACKED = {"live_store_eagle", "live_store_llama", "live_store_qwen3_next"}

CALL_TIMEOUT = 900


def test_the_live_fixtures_are_the_seven_recordings():
    """A new recording must be added to WHAT_IF_BLOCKS (and so to every test here)."""
    assert sorted(LIVE) == sorted(WHAT_IF_BLOCKS) == [
        "live_eagle", "live_llama", "live_qwen3_next", "live_qwen3_next_kv_events",
        "live_store_eagle", "live_store_llama", "live_store_qwen3_next"]


def _cli_many(calls: dict[str, tuple]) -> dict[str, subprocess.CompletedProcess]:
    """Independent CLI calls side by side (each its own process)."""
    workers = max(1, min(len(calls), os.cpu_count() or 1, 4))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(cli, *args, timeout=CALL_TIMEOUT)
                   for key, args in calls.items()}
        return {key: f.result() for key, f in futures.items()}


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _cached(run_json: dict) -> dict[str, int]:
    return {r["id"]: r["num_cached_tokens"] for r in run_json["requests"]}


def _run_commands(name: str, out: Path) -> dict:
    """Every command that takes a trace, on live fixture ``name``; their results."""
    path = LIVE[name].relative_to(REPO)
    blocks = json.loads((LIVE[name] / "header.json").read_text())["engine"]["num_gpu_blocks"]
    small = WHAT_IF_BLOCKS[name]
    # anonymize never imports vLLM: it runs first, its trace is replayed below.
    anon = cli("anonymize", path, "-o", out / "anon", "--secret", "00ff", timeout=CALL_TIMEOUT)
    procs = _cli_many({
        "run": ("run", path, "--json", out / "run.json"),
        "anon_run": ("run", out / "anon", "--json", out / "anon_run.json"),
        "what_if": ("run", path, "--set", f"engine.num_gpu_blocks={small}",
                    "--json", out / "what_if.json"),
        "diff": ("diff", path, "--engine", "installed", "--engine", "installed"),
        "explain": ("explain", path, "--json", out / "explain.json"),
        "sweep": ("sweep", path, "--grid", f"num_gpu_blocks={small},{blocks}", "--jobs", "1",
                  "--json", out / "sweep.json"),
    })
    procs["anonymize"] = anon
    # The report plots the sweep's JSON too: it needs the sweep first.
    procs["report"] = cli("report", path, "-o", out / "report.html",
                          "--sweep", out / "sweep.json", timeout=CALL_TIMEOUT)
    return {"name": name, "path": path, "out": out, "blocks": blocks, "small": small,
            "rows": read_trace(LIVE[name]).requests.num_rows, "procs": procs}


def _check_run_json_and_diff_of_an_engine_with_itself(live):
    _ok(live["procs"]["run"])
    run = _json(live["out"] / "run.json")
    assert run["summary"]["requests"] == live["rows"] == len(run["requests"])
    assert run["summary"]["cached_tokens"] == sum(_cached(run).values()) > 0
    diff = _ok(live["procs"]["diff"])
    assert f"identical: {live['rows']} requests, the same outcome on A and B" in diff.stdout


def _check_explain_json_accounts_for_every_lost_token(live):
    _ok(live["procs"]["explain"])
    explained = _json(live["out"] / "explain.json")
    actual = _cached(_json(live["out"] / "run.json"))
    reqs = explained["requests"]
    assert sorted(r["id"] for r in reqs) == sorted(actual)
    for r in reqs:
        assert r["actual"] == actual[r["id"]], r            # the baseline replay is run's
        assert r["reachable"] >= r["actual"], r
        assert r["reachable"] - r["actual"] == sum(r["lost"].values()), r
        assert (r["reachable_from"] is None) == (r["reachable"] == 0), r
    summary = explained["summary"]
    assert summary["reachable"] == sum(r["reachable"] for r in reqs)
    assert summary["actual"] == sum(actual.values())
    assert summary["lost"]["unexplained"] == 0
    # Every recording shares prefixes across requests, and vLLM reached some of them.
    assert summary["reachable"] >= summary["actual"] > 0


def _check_report_writes_the_page_of_explains_totals(live):
    proc = _ok(live["procs"]["report"])
    page = live["out"] / "report.html"
    summary = _json(live["out"] / "explain.json")["summary"]
    assert proc.stdout.strip() == (
        f"wrote {page}: {live['rows']} requests, hit rate {summary['hit_rate']:.1%} of "
        f"reachable {summary['reachable_rate']:.1%}, sweep of 2 point(s)")
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert (f"reachable {summary['reachable']} ({summary['reachable_rate']:.1%}), "
            f"actual {summary['actual']} ({summary['hit_rate']:.1%})") in html


def _check_sweep_points_are_explain_and_the_what_if_run(live):
    _ok(live["procs"]["sweep"])
    _ok(live["procs"]["what_if"])
    rows = {int(r["engine.num_gpu_blocks"]): r for r in _json(live["out"] / "sweep.json")["rows"]}
    assert sorted(rows) == sorted([live["small"], live["blocks"]])
    for row in rows.values():
        lost = sum(v for k, v in row.items() if k.startswith("lost_"))
        assert row["reachable"] - row["actual"] == lost, row
        assert row["lost_unexplained"] == 0, row
    # The trace's own geometry: the sweep's point is explain's replay.
    explained = _json(live["out"] / "explain.json")["summary"]
    own = rows[live["blocks"]]
    assert {k: own[k] for k in ("requests", "prompt_tokens", "reachable", "actual", "hit_rate",
                                "reachable_rate", "steps")} == {
        k: explained[k] for k in ("requests", "prompt_tokens", "reachable", "actual", "hit_rate",
                                  "reachable_rate", "steps")}
    assert {k[len("lost_"):]: v for k, v in own.items() if k.startswith("lost_")} == \
        explained["lost"]
    # The what-if run under --set is the sweep's other point, and differs from the trace's.
    what_if = _json(live["out"] / "what_if.json")["summary"]
    base = _json(live["out"] / "run.json")["summary"]
    small = rows[live["small"]]
    assert (what_if["cached_tokens"], what_if["hit_rate"], what_if["steps"]) == \
        (small["actual"], small["hit_rate"], small["steps"])
    if live["name"] in STORE_BACKED:
        assert (what_if["cached_tokens"], what_if["steps"]) == \
            (base["cached_tokens"], base["steps"])
    else:
        assert (what_if["cached_tokens"], what_if["steps"]) != \
            (base["cached_tokens"], base["steps"])


def _check_the_anonymized_recording_replays_to_the_same_hits(live):
    proc = _ok(live["procs"]["anonymize"])
    assert proc.stdout.startswith(f"wrote {live['out'] / 'anon'} ({live['rows']} requests; "
                                  "tokens replaced by ids of ")
    original = read_trace(LIVE[live["name"]]).requests
    anonymized = read_trace(live["out"] / "anon").requests
    assert "prompt_tokens" not in anonymized.column_names
    assert not anonymized["output_tokens"].equals(original["output_tokens"])
    _ok(live["procs"]["anon_run"])
    run = _json(live["out"] / "run.json")
    anon_run = _json(live["out"] / "anon_run.json")
    assert _cached(anon_run) == _cached(run)
    # Prefix equality kept exactly: the whole schedule is the same, not only the hits.
    assert anon_run["requests"] == run["requests"]
    assert anon_run["summary"] == run["summary"]


@pytest.mark.parametrize("name", sorted(LIVE))
def test_every_command_on_a_live_recording(name, tmp_path):
    """run --json, diff, explain --json, report, sweep, anonymize + run, run --set."""
    live = _run_commands(name, tmp_path)
    _check_run_json_and_diff_of_an_engine_with_itself(live)
    _check_explain_json_accounts_for_every_lost_token(live)
    _check_report_writes_the_page_of_explains_totals(live)
    _check_sweep_points_are_explain_and_the_what_if_run(live)
    _check_the_anonymized_recording_replays_to_the_same_hits(live)


def test_check_against_the_recording():
    """``check --against recorded`` of the seven recordings, in one call. Nothing
    refuses here: every live fixture has recorded outcomes and steps (the
    kv_events one recorded vLLM's KV-cache events too, compared here). Their
    goldens on the installed vLLM (the kv event goldens included) are checked by
    ``pytest fixtures/`` (scripts/run-tests.sh's golden-fixtures phase): a second
    replay of them here proved nothing more."""
    paths = [LIVE[name].relative_to(REPO) for name in sorted(LIVE)]
    recorded = _ok(cli("check", "--against", "recorded", *paths,
                       timeout=CALL_TIMEOUT)).stdout
    for name, path in zip(sorted(LIVE), paths):
        trace = read_trace(LIVE[name])
        line = (f"PASS {path}: replay matches the recording: {trace.outcomes.num_rows} "
                f"outcome(s), {trace.steps.num_rows} step row(s)")
        if trace.store_ops is not None:
            line += (f", {trace.store_ops.num_rows} store op(s), the same chunks per request, "
                     "3 request(s) first scheduled at another step (waiting on an "
                     "asynchronous store load)")
        if trace.kv_events is not None:
            line += f", {trace.kv_events.num_rows} kv event block(s)"
        assert line in recorded.splitlines(), recorded


# The root cause of explain's failure on recordings, without vLLM: recorded
# output tokens, and how many of them a later prompt can reach.

TURNS = """\
engine: {block_size: 16}
requests:
  - id: t1
    prompt: [{stream: doc, len: 104}]
    output_len: 40
  - id: t2
    after: t1
    prompt: [{stream: doc, len: 164}]
"""


def _recorded(tmp_path: Path, t2_output_part: np.ndarray, recorded: np.ndarray):
    """TURNS as a recording: t1 stored its 40 sampled tokens ``recorded``; t2's
    prompt is t1's prompt, then ``t2_output_part``, then 20 other tokens."""
    (tmp_path / "turns.yaml").write_text(TURNS)
    trace = load_target(tmp_path / "turns.yaml")
    rq = trace.requests
    prompts = rq["prompt_tokens"].to_pylist()
    tail = prompts[1][104 + len(t2_output_part):]
    prompts[1] = prompts[0] + [int(t) for t in t2_output_part] + tail
    rq = rq.set_column(rq.column_names.index("prompt_tokens"), "prompt_tokens",
                       pa.array(prompts, pa.list_(pa.int32())))
    rq = rq.set_column(rq.column_names.index("num_prompt_tokens"), "num_prompt_tokens",
                       pa.array([len(p) for p in prompts], pa.int64()))
    rq = rq.append_column(pa.field("output_tokens", pa.list_(pa.int32()), nullable=True),
                          pa.array([recorded.tolist(), None], pa.list_(pa.int32())))
    trace.requests = rq
    return trace


def test_reachable_counts_the_recorded_outputs_the_replay_fed_back(tmp_path):
    """t1's 40 recorded output tokens: the first 39 have KV (the last sampled
    token is never fed back). t2 repeats t1's prompt (104 tokens) and all 40:
    104 + 39 = 143 tokens are reachable, 8 whole blocks of 16 (counting the
    40th would reach 144 = 9 blocks)."""
    recorded = np.arange(1000, 1040, dtype=np.int64)
    trace = _recorded(tmp_path, recorded, recorded)
    got = reachable_hits(trace, trace_clock(trace))
    assert dict(zip(got["id"].to_list(), got["reachable"].to_list())) == {"t1": 0, "t2": 128}
    assert got["reachable_from"].to_list() == [None, "t1"]
    # The reachable tokens are the recorded ones, not the synthetic stream the
    # replay emits past them: a prompt with other tokens there reaches the prompt only.
    other = _recorded(tmp_path, recorded + 1, recorded)
    got = reachable_hits(other, trace_clock(other))
    assert got["reachable"].to_list() == [0, 96]
