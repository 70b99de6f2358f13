"""Time segments over a prefill/decode pair (two engines over one store): the sequential bytes.

The trace (tests/helpers_segments.py): the store test's waves (a new prompt,
the one before resent, a reset, its own resend, the prompt of three waves
ago resent, a reset) sent to a pair (engine.prefill_instance: a kv_producer
prefills each request, a kv_consumer decodes it from what the producer
wrote) over a memory store of three prompts, then a conversation: t2's prompt
holds t1's prompt and output. The decode instance names t1's output block by
t1 as it decodes it; the prefill instance, which never saw that output, by
t2, whose prefill puts it. A second trace evicts each prompt from the decode
instance after it, so at its boundary only the prefill instance remembers an
old prompt. The digest (replayer/replay/engines/digest/pair.py) holds the
decode instance's sections, the shared store once, and a section of the
pair's own: the prefill instance's state and the hand-off.
"""

from __future__ import annotations

import pytest

from helpers_segments import ENGINE, WAVES, waves_fixture
from replayer.check.output import dumps
from replayer.replay.segments import replay_segments, why_serial
from replayer.replay.segments.hosts import InProcessHost
from traces import load_target

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


def _evicts(path):
    """Ten prompts 10 steps apart, each evicted from the decode instance's cache
    after it (evict events are the decode instance's), over a store of three
    prompts; y resends prompt 3 first at step 70. A 128-token budget takes a
    whole prompt in two steps."""
    reqs, events = [], []
    for i in range(10):
        if i == 7:
            reqs.append("  - {id: y, arrival_step: 70, output_len: 2, "
                        "prompt: [{stream: s3, len: 256}]}")
        reqs.append(f"  - {{id: x{i}, arrival_step: {10 * i}, output_len: 2, "
                    f"prompt: [{{stream: s{i}, len: 256}}]}}")
        events.append(f"  - {{at_step: {10 * i + 6}, action: evict, request: x{i}}}")
    path.write_text(ENGINE.replace("2048", "128")
                    + "  connector: mooncake_store\n  mooncake_global_segment_size: 12KB\n"
                    "  connector_config: {kv_role: kv_consumer}\n"
                    "  prefill_instance:\n    connector_config: {kv_role: kv_producer}\n"
                    "requests:\n" + "\n".join(reqs) + "\nevents:\n" + "\n".join(events) + "\n")
    return load_target(path)


def test_what_only_the_prefill_instance_holds_fails_the_boundary(tmp_path, monkeypatch):
    """Two segments, a 30-step warm-up: at step 70 the exact path's prefill
    instance still holds blocks of prompt 3, which neither the decode instance
    (evicted), nor the store (its oldest out), nor the segment's prefill
    instance (its warm-up began at prompt 4) holds: only the pair section
    differs, segment 0 replays on, the bytes are the sequential replay's. With
    the section blanked the boundary passes, and y, whose prompt the exact
    path's prefill instance partly holds and prefills in one step, reaches the
    decode instance a step later; the prefill instance's store checks differ."""
    from replayer.replay.engines.digest import pair
    from replayer.replay.execution.clients import replay_on

    trace = _evicts(tmp_path / "pd_evicts.yaml")
    seq = replay_on(trace)
    res, report = replay_segments(trace, InProcessHost(), 2, 30)
    assert report.plan.boundaries == [70]
    assert report.matched == []
    assert _differing(report.checks[0]) == {"pair", "total"}
    assert dumps(res) == dumps(seq)
    assert res.store["rows"] == seq.store["rows"]
    sections = pair.pair_sections

    def blanked(*args):
        return {**sections(*args), "pair": ["blank"]}
    monkeypatch.setattr(pair, "pair_sections", blanked)
    res, report = replay_segments(trace, InProcessHost(), 2, 30)
    assert report.matched == [1]
    steps = {r.id: (r.prefill_step, r.finish_step) for r in res.requests}
    assert steps["y"] == tuple(s + 1 for s in {r.id: (r.prefill_step, r.finish_step)
                                                 for r in seq.requests}["y"])
    assert res.store["rows"] != seq.store["rows"]


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
