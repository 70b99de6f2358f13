"""Request fields that change what a request reads from the prefix cache are
recorded and replayed through vLLM's own request object (docs/recording.md,
"Request fields"); one that cannot be replayed is refused in one line.

``skip_reading_prefix_cache`` (what ``prompt_logprobs`` sets): a recording of a
request that never read the cache must replay to a miss, not to the hit the
cache holds for it.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import SCENARIOS
from replayer.check import recorded as fidelity
from traces import load_target
from traces.trace import read_trace

SKIPPED = "after_reset"          # the second of three identical 3,000-token prompts


def _with_skip(trace):
    """reset_prefix_cache.yaml without its reset, the middle request asking, as
    prompt_logprobs does, never to read the cache."""
    ids = trace.requests["id"].to_pylist()
    trace.requests = trace.requests.append_column(
        "skip_reading_prefix_cache", pa.array([True if i == SKIPPED else None for i in ids]))
    trace.events = None
    trace.goldens, trace.event_goldens = {}, {}
    return trace


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    out = tmp_path_factory.mktemp("fields") / "rec"
    result = fidelity.record_replay(_with_skip(load_target(SCENARIOS / "reset_prefix_cache.yaml")),
                                    out)
    return result, out


def test_a_request_that_skips_the_cache_replays_to_a_miss_and_is_recorded(recording):
    result, out = recording
    hits = {r.id: r.num_cached_tokens for r in result.requests}
    # Without the flag the middle request would hit 2992 like the last one.
    assert hits == {"first": 0, SKIPPED: 0, "again": 2992}
    trace = read_trace(out)
    assert trace.header["schema_version"] == 2
    assert dict(zip(trace.requests["id"].to_pylist(),
                    trace.requests["skip_reading_prefix_cache"].to_pylist())) == \
        {"first": None, SKIPPED: True, "again": None}
    assert trace.cut_step is None                      # stopped cleanly: whole


def test_the_recording_checks_against_itself_and_fails_without_the_field(recording, tmp_path):
    _, out = recording
    trace = read_trace(out)
    lines, ok, _ = fidelity.check_against_recorded(trace)
    assert ok, "\n".join(lines)
    # The recorder before this field: the replay reads the cache the request skipped.
    trace.requests = trace.requests.drop_columns(["skip_reading_prefix_cache"])
    lines, ok, _ = fidelity.check_against_recorded(trace)
    assert not ok
    assert f"  outcome of {SKIPPED}: num_cached_tokens recorded 0, replayed 2992" in lines


def test_multimodal_inputs_are_refused_in_one_line(recording):
    from replayer.replay.execution.clients import replay_on
    from replayer.replay.loop import ReplayError

    trace = read_trace(recording[1])
    mm = pa.array([None, [{"identifier": "img0", "offset": 10, "length": 64}], None],
                  trace.requests.schema.field("mm_inputs").type)
    trace.requests = trace.requests.set_column(
        trace.requests.column_names.index("mm_inputs"), "mm_inputs", mm)
    with pytest.raises(ReplayError) as err:
        replay_on(trace)
    assert str(err.value) == (f"request '{SKIPPED}' carries multimodal inputs (their hashes "
                              "enter its block hashes); multimodal replay is not supported yet")


def test_external_id_of_n_greater_than_1_names_the_sample():
    """vLLM fans a request with n > 1 out into n engine requests `<i>_<id>`:
    the recorded external id keeps the sample index, as docs/recording.md says."""
    from replayer.recorder.scheduler import external_id

    assert external_id("1_cmpl-abc-0-0123abcd") == "1_cmpl-abc-0"
    assert external_id("cmpl-abc-0-0123abcd") == "cmpl-abc-0"
