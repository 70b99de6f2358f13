"""A replay that hands its outcomes on as they complete (``sink``) and writes
``--json`` as it goes (:class:`replayer.check.output.JsonStream`) writes the same
bytes as one that keeps every outcome, and keeps none itself."""

from __future__ import annotations

import io

import pytest

from conftest import SCENARIOS, STORE_SCENARIOS, TRACES
from replayer.replay.loop import replay
from replayer.check.output import JsonStream, dumps
from replayer.replay.execution.in_process import engine_here
from traces import load_target

TARGETS = [TRACES / "conversation_500", SCENARIOS / "reset_prefix_cache.yaml",
           SCENARIOS / "shared_system_prompt_hybrid.yaml",
           STORE_SCENARIOS / "shared_prefix_junction.yaml"]


@pytest.mark.parametrize("path", TARGETS, ids=lambda p: p.name)
def test_streamed_json_is_the_same_bytes(path):
    trace = load_target(path)
    with engine_here(trace) as adapter:
        kept = replay(trace, adapter)
        whole = dumps(kept)
    out = io.StringIO()
    seen = []
    with engine_here(trace) as adapter:
        stream = JsonStream(out, adapter.info)

        def sink(outcome):
            seen.append(outcome.id)
            stream(outcome)

        result = replay(trace, adapter, sink=sink)
        stream.finish(result)
    assert result.requests == []
    # What only explain reads (it keeps every outcome) is not kept per request either.
    assert kept.finished_engine_step and kept.lookups
    assert kept.hits_are_first_prefill is True
    assert result.finished_engine_step == {} and result.lookups == {}
    assert result.summary()["requests"] == len(seen) == trace.requests.num_rows
    assert out.getvalue() == whole


def test_cli_json_file_is_spooled_and_the_same(tmp_path):
    """``run --json FILE`` streams outcomes to a spool (replayer.check.output.SpooledJson)
    and writes the bytes ``--json -`` prints from the whole result, with the same
    run table (its first and last 20 rows of 250; a recording, whose prompts
    stream from Parquet as conversation_500's, above, do in this process)."""
    from conftest import cli

    target = TRACES / "live_llama"
    spooled = cli("run", target, "--json", tmp_path / "out.json", "--no-progress")
    assert spooled.returncode == 0, spooled.stderr
    whole = cli("run", target, "--json", "-", "--no-progress")
    assert whole.returncode == 0, whole.stderr
    assert (tmp_path / "out.json").read_text() == whole.stdout
    assert "... 210 more requests" in spooled.stdout
    table = [ln for ln in whole.stderr.splitlines() if not ln.startswith("replayer:")]
    assert spooled.stdout.splitlines() == table
