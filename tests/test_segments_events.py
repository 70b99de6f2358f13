"""Time segments over targeted events (evict, store_remove, store_fault): the sequential bytes.

Those events read what a named request held, perhaps before a segment's
warm-up; the digest's events section writes the ones still to come and what
they will read (replayer/replay/engines/digest/events.py). Each trace is made
here: waves 40 steps apart, a reset ending each wave.
"""

from __future__ import annotations

import pytest

from helpers_segments import assert_waves_split
from replayer.check.output import dumps
from replayer.replay.segments import replay_segments, why_serial
from replayer.replay.segments.hosts import InProcessHost
from traces import load_target

WAVES = 8
ENGINE = ("engine:\n  block_size: 16\n  num_gpu_blocks: 64\n  max_num_batched_tokens: 2048\n"
          "  max_num_seqs: 4\n")


def _trace(tmp_path, name, engine, waves):
    reqs, events = [], []

    def req(rid, at, stream):
        reqs.append(f"  - {{id: {rid}, arrival_step: {at}, output_len: 2, "
                    f"prompt: [{{stream: s{stream}, len: 256}}]}}")

    def event(at, rest):
        events.append(f"  - {{at_step: {at}, {rest}}}")

    for j in range(WAVES):
        waves(j, 40 * j, req, event)
        event(40 * j + 38, "action: reset_prefix_cache")
    path = tmp_path / f"{name}.yaml"
    path.write_text(engine + "requests:\n" + "\n".join(reqs) + "\nevents:\n"
                    + "\n".join(events) + "\n")
    return load_target(path)


def _evict_waves(j, t, req, event):
    """A new prompt, its resend (a hit), an evict of it, a resend again (a
    miss); in wave 6, prompt 3 again and an evict naming n3 (step 120)."""
    req(f"n{j}", t, j)
    req(f"q{j}", t + 8, j)
    event(t + 16, f"action: evict, request: n{j}")
    req(f"r{j}", t + 20, j)
    if j == 6:
        req("o6", t + 26, 3)
        req("p6", t + 30, 3)
        event(t + 32, "action: evict, request: n3")
        req("x6", t + 34, 3)


def _store_waves(j, t, req, event):
    """tests/test_segments_store.py's waves, plus: a get fault on n4's keys armed
    at step 170 (r4's load fails at 180), n4's keys removed at 184 (x4 misses),
    a lookup fault on n3's keys (step 120) armed at 262 (w6 meets it), and one
    on n7's (arriving at 280) armed at 292 (r7 meets it)."""
    req(f"n{j}", t, j)
    if j >= 1:
        req(f"q{j}", t + 8, j - 1)
    event(t + 18, "action: reset_prefix_cache")
    req(f"r{j}", t + 20, j)
    if j >= 3:
        req(f"o{j}", t + 28, j - 3)
    if j == 4:
        event(t + 10, "action: store_fault, op: get, keys: [{request: n4}]")
        event(t + 24, "action: store_remove, keys: [{request: n4}]")
        event(t + 25, "action: reset_prefix_cache")
        req("x4", t + 26, 4)
    if j == 6:
        event(t + 22, "action: store_fault, op: lookup, keys: [{request: n3}]")
        req("w6", t + 26, 3)
    if j == 7:
        event(t + 12, "action: store_fault, op: lookup, keys: [{request: n7}]")


@pytest.fixture(scope="module")
def evicts(tmp_path_factory):
    from replayer.replay.execution.clients import replay_on

    trace = _trace(tmp_path_factory.mktemp("evicts"), "evict_waves", ENGINE, _evict_waves)
    return trace, replay_on(trace)


@pytest.fixture(scope="module")
def store_events(tmp_path_factory):
    from replayer.replay.execution.clients import replay_on

    engine = ENGINE + "  connector: mooncake_store\n  mooncake_global_segment_size: 12KB\n"
    trace = _trace(tmp_path_factory.mktemp("store_events"), "store_events", engine,
                   _store_waves)
    return trace, replay_on(trace)


def _blank_events(monkeypatch):
    from replayer.replay.engines.digest import events as digest_events

    monkeypatch.setattr(digest_events, "events_section", lambda d, engine, pending: [])


def test_evicts_split_with_the_sequential_bytes(evicts, monkeypatch):
    """Three segments, a 110-step warm-up. At step 168 every evict to come names
    a request the segment holds: the boundary matches. At 240 the evict of n3
    (arrived at 120, before the segment's warm-up at 130) is not in the
    segment's part: only the events section differs, and the segment before
    replays on. With the section blanked that boundary passes and x6 hits
    what the exact path evicted."""
    trace, seq = evicts
    assert why_serial(trace) is None
    hits = {r.id: r.num_cached_tokens for r in seq.requests}
    assert (hits["p6"], hits["x6"]) == (240, 0)
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.plan.boundaries == [168, 240]
    assert report.matched == [1]
    failed = report.checks[1]
    assert {k for k in failed.exact if failed.exact[k] != failed.started[k]} == {"events",
                                                                                  "total"}
    assert dumps(res) == dumps(seq)
    _blank_events(monkeypatch)
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.matched == [1, 2]
    assert {r.id: r.num_cached_tokens for r in res.requests}["x6"] == 240


def test_store_removes_and_faults_split_with_the_sequential_bytes(store_events, monkeypatch):
    """At step 180 the fault armed on n4's keys, their removal and the faults
    to come name requests (n7 not yet arrived) whose hashes are named alike on
    both sides: the boundary matches. At 260 the lookup fault to come names
    n3, which arrived before segment 2's warm-up: only the events section
    differs, and the segment before replays on. The --json bytes, every store
    row and each fault's firings are the sequential replay's. With the events
    section blanked, 260 passes and the fault on n3's keys never fires."""
    trace, seq = store_events
    assert why_serial(trace) is None
    by_id = {r.id: r for r in seq.requests}
    assert by_id["r4"].num_cached_tokens is None and by_id["x4"].num_cached_tokens == 0
    assert [f["fired"] for f in seq.store["faults"]] == [1, 1, 1]
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert_waves_split(res, report, seq, "events")
    assert res.store["rows"] == seq.store["rows"]
    assert res.store["faults"] == seq.store["faults"]
    assert res.notes == seq.notes
    _blank_events(monkeypatch)
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.matched == [1, 2]
    assert [f["fired"] for f in res.store["faults"]] == [1, 0, 1]
    assert res.store["rows"] != seq.store["rows"]
