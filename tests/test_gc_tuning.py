"""The replay loop runs with fewer garbage-collector passes, and that changes nothing.

:mod:`replayer.replay.gc_tuning` raises the young-generation threshold while
:func:`replayer.replay.loop.replay` runs and restores it after, even when the replay
fails; the outcomes are byte-identical to a loop under Python's own thresholds.
"""

from __future__ import annotations

import contextlib
import gc

import pytest

from conftest import MOONCAKE_TRACE, TRACES
from replayer.replay.gc_tuning import REPLAY_GEN0_THRESHOLD, REPLAY_GEN2_THRESHOLD, fewer_gc_passes
from replayer.replay.loop import ReplayError, replay
from replayer.check.output import dumps
from replayer.replay.execution.in_process import engine_here
from test_schedule import FakeEngine, run
from traces import load_target


class ThresholdSeen(FakeEngine):
    """Notes the collector's thresholds at every step."""

    def __init__(self, stuck: bool = False) -> None:
        super().__init__(stuck)
        self.thresholds: set[tuple[int, ...]] = set()

    def step(self):
        self.thresholds.add(gc.get_threshold())
        return super().step()


RAISED = (REPLAY_GEN0_THRESHOLD, 10, REPLAY_GEN2_THRESHOLD)

SCENARIO = """\
    requests:
      - {id: a, prompt: {stream: s, len: 64}, output_len: 4}
      - {id: b, arrival_step: 2, prompt: {stream: t, len: 64}, output_len: 3}
"""


@pytest.fixture
def python_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield (700, 10, 10)
    gc.set_threshold(*before)


def test_loop_runs_with_the_raised_threshold_and_restores_it(tmp_path, python_thresholds):
    engine = ThresholdSeen()
    run(tmp_path, SCENARIO, engine)
    assert engine.thresholds == {RAISED}
    assert gc.get_threshold() == python_thresholds


def test_threshold_restored_when_the_replay_fails(tmp_path, python_thresholds):
    with pytest.raises(ReplayError):
        run(tmp_path, SCENARIO, ThresholdSeen(stuck=True))
    assert gc.get_threshold() == python_thresholds


def test_higher_thresholds_and_a_disabled_collector_are_kept(python_thresholds):
    for given, inside in (((100_000, 5, 500), (100_000, 5, 500)),
                          ((100_000, 5, 5), (100_000, 5, REPLAY_GEN2_THRESHOLD)),
                          ((0, 10, 10), (0, 10, 10))):
        gc.set_threshold(*given)
        with fewer_gc_passes():
            assert gc.get_threshold() == inside
        assert gc.get_threshold() == given


def test_engine_is_built_under_the_raised_threshold(monkeypatch, python_thresholds):
    """vLLM's import and EngineCore's build (runner.engine_here) run with it too."""
    import replayer.replay.execution.in_process as runner

    seen = []

    class Built:
        def close(self):
            seen.append(("close", gc.get_threshold()))

    def open_engine(*args, **kwargs):
        seen.append(("build", gc.get_threshold()))
        return Built()

    monkeypatch.setattr(runner, "open_engine", open_engine)
    with runner.engine_here(load_target(TRACES / "conversation_500")):
        seen.append(("use", gc.get_threshold()))
    assert seen == [("build", RAISED), ("use", python_thresholds),
                    ("close", python_thresholds)]


def test_outcomes_identical_under_pythons_own_thresholds(python_thresholds, monkeypatch):
    """The conversation trace's first 120 requests through vLLM (the plain loop
    collects many times over them; all 500 cost two replays of 7M prompt tokens
    for the same proof): the tuned loop against the plain one (the
    same loop with the tuning swapped for a context that does nothing), same
    ``--json`` bytes."""
    import replayer.replay.loop as loop_module
    from traces.importers.mooncake import import_mooncake

    trace = import_mooncake(MOONCAKE_TRACE, limit=120)
    out = []
    for tuned in (False, True):
        if not tuned:
            monkeypatch.setattr(loop_module, "fewer_gc_passes", contextlib.nullcontext)
        else:
            monkeypatch.undo()
        with engine_here(trace) as adapter:
            passes = []
            gc.callbacks.append(cb := lambda phase, info: passes.append(phase))
            try:
                out.append(dumps(replay(trace, adapter)))
            finally:
                gc.callbacks.remove(cb)
        out.append(len(passes))
    plain_json, plain_passes, tuned_json, tuned_passes = out
    assert tuned_json == plain_json
    # The comparison means something: the plain loop did collect, the tuned one less.
    assert plain_passes > tuned_passes
