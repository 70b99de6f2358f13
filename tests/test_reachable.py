"""Reachable hits from the trace alone (polars; no vLLM, no replay)."""

from __future__ import annotations

import subprocess
import sys

import polars as pl

from conftest import REPO
from helpers_traces import write_text
from traces import load_target
from traces import reachable as reach_mod
from traces.reachable import Clock, reachable_hits, trace_clock

TURNS = """\
engine: {block_size: 16}
requests:
  - id: t1
    prompt: [{stream: doc, len: 100}]
    output_len: 40
  - id: t2
    after: t1
    prompt: [{stream: doc, len: 100}, {stream: "out:t1", len: 39}, {stream: q, len: 20}]
  - id: salted
    after: t2
    cache_salt: s
    prompt: [{stream: doc, len: 100}]
  - id: short
    after: salted
    prompt: [{stream: doc, len: 33}]
  - id: other
    arrival_step: 0
    prompt: [{stream: zzz, len: 50}]
"""


def _by_id(df: pl.DataFrame) -> dict[str, int]:
    return dict(zip(df["id"].to_list(), df["reachable"].to_list()))


def test_outputs_salt_and_cap(tmp_path):
    trace = load_target(write_text(tmp_path / "turns.yaml", TURNS))
    got = _by_id(reachable_hits(trace))
    # t2 shares t1's prompt and the 39 output tokens t1 computed (its last
    # sampled token has no KV): 139 tokens -> 8 whole units of 16.
    assert got["t2"] == 128
    assert got["salted"] == 0            # another cache salt shares nothing
    # 33 tokens: vLLM looks up at most 32, which is 2 whole units.
    assert got["short"] == 32
    assert got["t1"] == 0 and got["other"] == 0


def test_output_seen_only_after_its_request_finished(tmp_path):
    trace = load_target(write_text(tmp_path / "turns.yaml", TURNS))
    order = trace_clock(trace).order
    assert order == ["t1", "t2", "salted", "short", "other"]
    finish = dict.fromkeys(order, 99)
    finish["t1"] = 5
    # t1 finishes in step 5; t2 looked up in step 5 cannot see its output yet.
    early = Clock(order=order, step=dict(zip(order, [0, 5, 7, 8, 9])), finish_step=finish)
    late = Clock(order=order, step=dict(zip(order, [0, 6, 7, 8, 9])), finish_step=finish)
    assert _by_id(reachable_hits(trace, early))["t2"] == 96     # the prompt's 100 tokens only
    assert _by_id(reachable_hits(trace, late))["t2"] == 128


def test_lookup_order_decides_who_sees_whom(tmp_path):
    trace = load_target(write_text(tmp_path / "turns.yaml", TURNS))
    order = trace_clock(trace).order
    swapped = [r for r in order if r != "short"]
    swapped.insert(0, "short")                # looked up first: nothing before it
    clock = Clock(order=swapped, step=dict.fromkeys(order, 0),
                  finish_step=dict.fromkeys(order))
    got = reachable_hits(trace, clock)
    assert _by_id(got)["short"] == 0
    assert got.filter(pl.col("id") == "t2")["reachable_from"].item() == "t1"


def test_block_ids_hash_like_tokens():
    """The block-id shortcut gives exactly what hashing the synthesised tokens gives."""
    trace = load_target(REPO / "fixtures" / "traces" / "conversation_500")
    fast = reachable_hits(trace)
    orig = reach_mod._token_hashed
    reach_mod._token_hashed = lambda *_: True
    try:
        slow = reachable_hits(trace)
    finally:
        reach_mod._token_hashed = orig
    assert fast["reachable"].sum() > 0
    assert fast.equals(slow)


def test_reachable_imports_no_vllm():
    code = ("import sys, traces.reachable, traces.scenarios.what_if\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
