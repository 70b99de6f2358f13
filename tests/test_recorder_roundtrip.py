"""Recording vLLM's real EngineCore (driven by the null model) and replaying the recording.

Every bundled fixture, with and without the MooncakeStore connector: the
recording's outcomes equal the original replay's, and a replay of the
recording reproduces its outcomes, schedule and store keys. Then the
anonymised recording, held-back drafts, and the CLI's --against recorded.
"""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from conftest import SCENARIOS, STORE_SCENARIOS, TRACES, cli
from replayer.check import recorded as fidelity
from replayer.replay.store import StoreSpec
from traces import load_target
from traces.model.schema import OUTCOME_FIELDS
from traces.trace import Trace, read_trace, write_trace

# A prefill/decode pair (engine.prefill_instance) is two engines; a recording
# holds one, so recording its replay is refused (engines.open_engine).
FIXTURES = sorted(SCENARIOS.glob("*.yaml")) + sorted(
    p for p in STORE_SCENARIOS.glob("*.yaml")
    if load_target(p).engine.prefill_instance is None) + sorted(
    p for p in TRACES.iterdir() if p.is_dir())
FIELDS = OUTCOME_FIELDS


def store_for(trace):
    return StoreSpec("memory") if trace.engine.connector else None


class _Recordings(dict):
    """fixture name -> (original replay result, recorded trace dir), recorded on first use:
    an xdist worker records only the fixtures its own tests read (each was recorded
    by both workers when the whole set was made up front)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        trace = load_target(PATHS[name])
        rec = self.root / name
        self[name] = fidelity.record_replay(trace, rec, store=store_for(trace)), rec
        return self[name]


PATHS = {p.stem: p for p in FIXTURES}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    return _Recordings(tmp_path_factory.mktemp("recordings"))


@pytest.mark.parametrize("name", [p.stem for p in FIXTURES])
def test_recording_holds_what_the_engine_reported_and_replays_to_it(recordings, name):
    """One test a fixture (its recording made once, on one worker): what the recording
    holds, then a replay of it against it."""
    result, rec = recordings[name]
    trace = read_trace(rec)
    assert trace.header["source"]["kind"] == "recorded"
    assert trace.skipped_parts == []
    original = {r.id: r.as_dict() for r in result.requests}
    recorded = {r["id"]: r for r in trace.outcomes.to_pylist()}
    prefilled = {k for k, r in original.items() if r["num_cached_tokens"] is not None}
    assert set(recorded) == prefilled
    for rid in prefilled:
        assert tuple(recorded[rid][f] for f in FIELDS) == tuple(original[rid][f] for f in FIELDS)
    # Requests in arrival order, with what the engine received.
    assert trace.requests["id"].to_pylist() == [r.id for r in result.requests]
    assert trace.requests["num_prompt_tokens"].to_pylist() == [
        r.num_prompt_tokens for r in result.requests]
    steps = trace.steps["step"].to_pylist()
    assert steps == sorted(steps) and set(steps) <= set(range(result.steps))
    if trace.engine.connector:
        puts = [r for r in trace.store_ops.to_pylist() if r["op"] == "put" and r["result"] >= 0]
        assert sorted(r["key"] for r in puts) == sorted(
            r["key"] for r in result.store["rows"] if r["op"] == "put" and r["result"] >= 0)
        # vLLM's kv_consumer saves nothing (skip_save on every request): no puts is right there.
        consumer = (trace.engine.connector_config or {}).get("kv_role") == "kv_consumer"
        assert bool(puts) != consumer
        assert all(r["boundary"] is not None for r in puts)
    else:
        assert trace.store_ops is None
    lines, ok, _ = fidelity.check_against_recorded(trace, store=store_for(trace))
    assert ok, "\n".join(lines)


def test_anonymized_recording_replays_to_the_same_outcomes(recordings, tmp_path):
    from replayer.analysis.anonymize import anonymize, default_unit

    for name in ("vllm51295_turn1_24577", "resend_after_reset", "conversation_500"):
        trace = read_trace(recordings[name][1])
        anon_dir = write_trace(anonymize(trace, secret=b"k"), tmp_path / name)
        anon = read_trace(anon_dir)
        assert "prompt_tokens" not in anon.requests.column_names
        assert anon.header["prompt_blocks"]["block_tokens"] == default_unit(trace.engine)
        # No original token list survives (token 0 padding aside).
        assert anon.requests["output_tokens"].to_pylist() != trace.requests[
            "output_tokens"].to_pylist()
        lines, ok, _ = fidelity.check_against_recorded(anon, store=store_for(anon))
        assert ok, f"{name}: " + "\n".join(lines)


def test_replay_honours_recorded_rejected_drafts(recordings, tmp_path):
    """A recording where every draft was rejected replays with every draft rejected."""
    scenario = tmp_path / "decode.yaml"
    scenario.write_text(DECODING)
    fidelity.record_replay(load_target(scenario), tmp_path / "rec")
    trace = read_trace(tmp_path / "rec")
    steps = trace.steps
    acc = steps["num_accepted_tokens"]
    assert pc.max(acc).as_py() >= 1                      # the null model accepts drafts
    zeroed = pa.array([None if a is None else 0 for a in acc.to_pylist()], pa.int64())
    steps = steps.set_column(steps.column_names.index("num_accepted_tokens"),
                             steps.schema.field("num_accepted_tokens"), zeroed)
    held = Trace(header=trace.header, requests=trace.requests, events=trace.events,
                 steps=steps)
    fresh_dir = tmp_path / "held"
    fidelity.record_replay(held, fresh_dir)
    fresh = read_trace(fresh_dir)
    held_at = {(r["step"], r["id"]) for r in trace.steps.to_pylist()
               if r["num_accepted_tokens"] is not None}
    got = [r["num_accepted_tokens"] for r in fresh.steps.to_pylist()
           if (r["step"], r["id"]) in held_at and r["num_accepted_tokens"] is not None]
    assert len(got) > 5 and set(got) == {0}
    # One token a step instead of three: the schedule is longer.
    assert fresh.steps["step"][-1].as_py() > trace.steps["step"][-1].as_py()


DECODING = """\
engine:
  block_size: 16
  speculative: {method: eagle, num_speculative_tokens: 2}
requests:
  - {id: a, prompt: [{stream: doc, len: 100}], output_len: 30}
  - {id: b, arrival_step: 3, prompt: [{stream: doc, len: 120}], output_len: 30}
"""


def test_cli_check_against_recorded_passes_then_fails_on_a_changed_outcome(recordings, tmp_path):
    rec = tmp_path / "rec"
    shutil.copytree(recordings["vllm51295_turn1_24577"][1], rec)
    proc = cli("check", "--against", "recorded", rec, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"PASS {rec}: replay matches the recording: 2 outcome(s)")
    part = next((rec / "outcomes").glob("part-*.parquet"))
    table = read_trace(rec).outcomes
    cached = [c + 128 if rid == "turn2" else c for rid, c in
              zip(table["id"].to_pylist(), table["num_cached_tokens"].to_pylist())]
    table = table.set_column(2, table.schema.field("num_cached_tokens"), pa.array(cached, pa.int64()))
    import pyarrow.parquet as pq

    pq.write_table(table, part)
    proc = cli("check", "--against", "recorded", rec, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "outcome of turn2: num_cached_tokens recorded 24576, replayed 24448" in proc.stdout


def test_against_recorded_needs_outcomes(tmp_path):
    proc = cli("check", "--against", "recorded", SCENARIOS / "reset_prefix_cache.yaml")
    assert proc.returncode == 2
    assert "has no outcomes table" in proc.stderr and len(proc.stderr.splitlines()) == 1


class _Config:
    """A stand-in vLLM config: what record_into reads, weakly referable as vLLM's is."""

    def __init__(self, async_scheduling=False):
        from types import SimpleNamespace

        self.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
        self.kv_transfer_config = None


def test_the_replays_recording_scheduler_pickles_by_reference(tmp_path):
    """vLLM's multiprocess executor pickles the config (its scheduler class with it)
    for its rank processes at TP > 1: the replay records through the module-level
    classes ``vllm serve`` loads (found by name), the directory kept in the engine
    process for the config it was installed into and taken once; another config,
    or a later one at a freed config's id, records nothing."""
    import pickle
    import weakref
    from types import SimpleNamespace

    from replayer.recorder import scheduler as rs
    from replayer.recorder.install import install_recorder

    config, out = _Config(), str(tmp_path / "rec")
    install_recorder(config, out)
    cls = config.scheduler_config.scheduler_cls
    assert cls is rs.RecordingScheduler and pickle.loads(pickle.dumps(cls)) is cls
    again = pickle.loads(pickle.dumps(SimpleNamespace(scheduler_cls=cls))).scheduler_cls
    assert again is rs.RecordingScheduler
    assert rs.record_into(_Config(async_scheduling=True), out) is rs.RecordingAsyncScheduler
    assert rs._recording_to(_Config()) is None
    assert rs._recording_to(config) == out and rs._recording_to(config) is None
    other = _Config()
    rs._RECORD_TO[id(config)] = (weakref.ref(other), out)    # as if at a freed config's id
    assert rs._recording_to(config) is None
    rs._RECORD_TO.clear()
