"""Time segments over vLLM's OffloadingConnector (CPU offload): the sequential bytes.

The trace: tests/helpers_segments.py's waves (a new prompt,
the one before resent, a reset, its own resend, the prompt of three waves
ago resent, a reset) over a CPU tier of ten prompts (LRU), and in the last
wave a resend of the first prompt, which only a tier that kept it serves.
The digest's offload section (replayer/replay/engines/digest/offload.py)
holds the tier's keys, reference counts, free chunks and LRU order.
"""

from __future__ import annotations

from helpers_segments import WAVES, assert_waves_split, waves_fixture
from replayer.replay.segments import replay_segments, why_serial
from replayer.replay.segments.hosts import InProcessHost

CPU_BYTES = 10 * 16 * 4096          # ten prompts of 16 one-page chunks

waves = waves_fixture("offload", "offload_waves.yaml",
                      "  connector: offloading\n  connector_config:\n"
                      f"    cpu_bytes_to_use: {CPU_BYTES}\n", last=("z7", 40 * WAVES - 8, 0))


def test_an_offloading_trace_splits_with_the_sequential_bytes(waves, monkeypatch):
    """Three segments, a 110-step warm-up. At step 180 the segment's tier holds
    the exact path's keys in the same LRU order: the boundary matches. At 260
    the exact path's tier still holds prompt 0, which no request of the
    segment's warm-up sent: only the offload section differs, and the segment
    before replays on. The --json bytes and every CPU-tier row are the
    sequential replay's. With the section blanked, 260 passes and z7 misses
    the prompt the exact path loads from the CPU tier."""
    from replayer.replay.engines.digest import offload

    trace, seq = waves
    assert why_serial(trace) is None
    assert {r.id: r.num_external_cached_tokens for r in seq.requests}["z7"] == 256
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert_waves_split(res, report, seq, "offload")
    assert res.store["rows"] == seq.store["rows"] and res.notes == seq.notes
    monkeypatch.setattr(offload, "offload_section", lambda d, engine: ["blank"])
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.matched == [1, 2]
    assert {r.id: r.num_external_cached_tokens for r in res.requests}["z7"] == 0
