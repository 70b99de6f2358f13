"""Time segments over a prefill/decode pair (two engines over one store): the sequential bytes.

The trace (tests/helpers_segments.py): the store test's waves (a new prompt,
the one before resent, a reset, its own resend, the prompt of three waves
ago resent, a reset) sent to a pair (engine.prefill_instance: a kv_producer
prefills each request, a kv_consumer decodes it from what the producer
wrote) over a memory store of three prompts, then a conversation: t2's prompt
holds t1's prompt and output. The decode instance names t1's output block by
t1 as it decodes it; the prefill instance, which never saw that output, by
t2, whose prefill puts it. The digest (replayer/replay/engines/digest/pair.py)
holds the decode instance's sections, the shared store once, and a section
of the pair's own: the prefill instance's state and the hand-off.
"""

from __future__ import annotations

import pytest

from helpers_segments import WAVES, waves_fixture
from replayer.check.output import dumps
from replayer.replay.segments import replay_segments, why_serial
from replayer.replay.segments.hosts import InProcessHost

waves = waves_fixture(
    "pd", "pd_waves.yaml",
    "  connector: mooncake_store\n  mooncake_global_segment_size: 12KB\n"
    "  connector_config: {kv_role: kv_consumer}\n"
    "  prefill_instance:\n    connector_config: {kv_role: kv_producer}\n",
    more=(f"{{id: t1, arrival_step: {40 * WAVES}, output_len: 17, "
          "prompt: [{stream: s100, len: 256}]}",
          f"{{id: t2, arrival_step: {40 * WAVES + 30}, output_len: 2, "
          "prompt: [{stream: s100, len: 256}, {stream: 'out:t1', len: 16}]}"))


def _differing(check) -> set[str]:
    return {k for k in check.exact if check.exact[k] != check.started[k]}


def test_a_pd_pair_splits_with_the_sequential_bytes(waves):
    """Three segments, a 110-step warm-up. At steps 200 and 288 both instances
    and the store they share hold what the exact path's do: both boundaries
    match. The --json bytes and every store row are the sequential replay's;
    t1's output block (in the last segment) is named by t1 in the decode
    instance's rows and by t2 in the prefill instance's, as sequentially (one
    map for both would name them alike)."""
    trace, seq = waves
    assert why_serial(trace) is None
    assert sum(r.num_external_cached_tokens for r in seq.requests) > 0
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.plan.boundaries == [200, 288]
    assert report.matched == [1, 2]
    assert dumps(res) == dumps(seq)
    assert res.store["rows"] == seq.store["rows"]
    assert res.store["lookups"] == seq.store["lookups"]
    assert res.store["gets_checked"] == seq.store["gets_checked"] > 0
    named = {r["request"] for r in res.store["rows"] if r["boundary"] == 272}
    assert named == {"t1", "t2"}


def test_the_pair_section_fails_closed(waves, monkeypatch):
    """The pair's own step clock walked into its section (it counts from each
    replay's start, so it differs at every boundary): both boundaries, whose
    other sections match, differ in the pair section alone, neither is
    trusted (segment 0 replays the whole trace), and the bytes are still the
    sequential replay's."""
    from replayer.replay.engines.digest import pair

    trace, seq = waves
    monkeypatch.delitem(pair.EXCLUDED["PrefillDecodePair"], "_steps")
    res, report = replay_segments(trace, InProcessHost(), 3, 110)
    assert report.matched == []
    assert [_differing(c) for c in report.checks] == [{"pair", "total"}] * 2
    assert dumps(res) == dumps(seq)
    assert res.store["rows"] == seq.store["rows"]


def test_a_store_event_to_come_leaves_a_pair_boundary_untrusted():
    """Each instance names keys by its own first requests; the events section
    reads one engine's names, so a store event to come is not digested."""
    from types import SimpleNamespace

    from replayer.replay.engines.digest.events import Pending
    from replayer.replay.engines.digest.pair import pair_sections
    from replayer.replay.engines.digest.walk import DigestError

    pair = SimpleNamespace(decode=SimpleNamespace(session=None))
    pending = Pending([{"action": "store_remove", "at_step": 5,
                        "keys": [{"request": "a", "group": None, "boundary": None,
                                  "rank": None}]}], lambda rid: None)
    with pytest.raises(DigestError, match="prefill/decode pair"):
        pair_sections(pair, pending, lambda *a: {}, None)
