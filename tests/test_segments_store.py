"""Time segments over a MooncakeStore trace, and with KV-cache events: the sequential bytes.

The trace (tests/helpers_segments.py): waves of requests 40 steps apart over a
memory store that holds three prompts (it evicts its oldest keys first). Each
wave sends a new prompt, resends the one before (served from the store),
resends its own after the GPU cache is reset, and resends the prompt of three waves ago
(evicted from the store by then: put again, its keys named by the request that
first held them, before any later segment's warm-up). A reset ends each
wave, so at a boundary the GPU side is empty on both paths and only the store
can tell them apart.
"""

from __future__ import annotations

from helpers_segments import assert_waves_split, waves_fixture
from replayer.check.output import dumps
from replayer.replay.segments import replay_segments, why_serial
from replayer.replay.segments.hosts import InProcessHost
from traces import load_target

waves = waves_fixture("waves", "store_waves.yaml",
                      "  connector: mooncake_store\n  mooncake_global_segment_size: 12KB\n")


def test_a_store_trace_splits_with_the_sequential_bytes(waves):
    """Three segments, a warm-up of 110 steps (two waves and a half). At step 180
    the segment's store holds what the exact path's does, in the same order: the
    boundary matches. At step 260 the warm-up put again a prompt the exact path
    still held (a FIFO store keeps it where it was first put): only the store
    section differs, the boundary fails, and the segment before replays on. The
    --json bytes and every store row (keys named by their first request) are the
    sequential replay's."""
    trace, seq = waves
    assert why_serial(trace) is None
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert_waves_split(res, report, seq, "store")
    assert res.store["rows"] == seq.store["rows"]
    assert res.store["lookups"] == seq.store["lookups"]
    assert res.store["gets_checked"] == seq.store["gets_checked"] > 0
    # o4 (step 188, segment 1's) puts again the prompt n1 put first (step 40, before
    # that segment's warm-up): its keys are named by n1, as sequentially.
    puts = [r["request"] for r in res.store["rows"] if r["op"] == "put"]
    assert puts.count("n1") == 32 and "o4" not in puts


def test_the_store_section_is_what_fails_that_boundary(waves, monkeypatch):
    """The same replay with the store left out of the digest: the boundary at
    step 260 passes, and the result is not the sequential replay's."""
    from replayer.replay.engines.digest import store as digest_store

    trace, seq = waves
    monkeypatch.setattr(digest_store, "store_section", lambda d, engine: ["blank"])
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.matched == [1, 2]
    assert res.store["rows"] != seq.store["rows"]


def test_a_real_master_keeps_a_store_trace_in_one_piece(waves):
    """The digest reads the memory store's contents (at any capacity); a real
    master's it cannot, so such a replay is not split."""
    from replayer.replay.segments.worker import serial_reason
    from replayer.replay.store import StoreSpec

    trace, _ = waves
    assert serial_reason(trace, "installed", StoreSpec("memory", capacity_bytes=1 << 20)) is None
    why = serial_reason(trace, "installed", StoreSpec("mooncake", "127.0.0.1", 5))
    assert "mooncake://127.0.0.1:5" in why and "cannot read" in why


def test_kv_events_split_with_the_sequential_rows():
    """KV-cache events (run --kv-events) on the recorded EAGLE fixture: both
    boundaries match, and the rows, each block named by the first request that
    held it (some before the segment's warm-up: the head names them), are the
    sequential replay's."""
    from conftest import TRACES

    from replayer.replay.execution.clients import replay_on

    trace = load_target(TRACES / "live_eagle")
    trace.kv_events_wanted = True
    seq = replay_on(trace)
    res, report = replay_segments(trace, InProcessHost(), 3, 50)
    assert report.matched == [1, 2]
    assert res.kv_events == seq.kv_events
    assert dumps(res) == dumps(seq)
