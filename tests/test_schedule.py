"""The step clock's rules, on a fake engine: no vLLM, milliseconds per test.

:func:`replayer.replay.loop.replay` is a pure loop over the engine it is handed, so
these drive it with :class:`FakeEngine`, which logs every call and finishes a
request ``output_len`` steps after it entered (the first of them its prefill).
"""

from __future__ import annotations

import textwrap

import pytest

from replayer.replay.engines.base import (EngineAdapter, EngineInfo, EngineRequest, PrefillOutcome,
                                   StepResult)
from replayer.replay.loop import MAX_IDLE_STEPS, MIN_STUCK_STEPS, ReplayError, replay
from replayer.replay.schedule import Schedule
from traces.scenarios.compile import compile_scenario


class FakeEngine(EngineAdapter):
    """Every running request advances one token a step; nothing is ever cached."""

    def __init__(self, stuck: bool = False, thrashing: bool = False) -> None:
        super().__init__()
        self.info = EngineInfo("0.0.0", "fake")
        self.log: list[str] = []
        self.steps = 0
        self.stuck = stuck                   # never schedules anything
        self.thrashing = thrashing           # computes every step, finishes nothing
        self.running: dict[str, list[int]] = {}   # id -> [tokens still to emit, prompt len]
        self.closed = False

    def add_request(self, request: EngineRequest) -> None:
        self.log.append(f"add {request.id} before step {self.steps}")
        self.running[request.id] = [request.output_len, len(request.prompt_tokens)]

    def step(self) -> StepResult:
        self.steps += 1
        if self.stuck:
            return StepResult(executed=False)
        if self.thrashing:                   # preempted and recomputed, again and again
            return StepResult(executed=True)
        out = StepResult(executed=bool(self.running))
        for rid, state in list(self.running.items()):
            if state[1]:                     # first step: the prefill
                out.prefills.append(PrefillOutcome(rid, state[1], 0, 0, 0))
                state[1] = 0
            state[0] -= 1
            if state[0] == 0:
                del self.running[rid]
                out.finished.append(rid)
        return out

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.stuck or self.thrashing

    def reset_prefix_cache(self) -> bool:
        self.log.append(f"reset before step {self.steps}")
        return True

    def abort(self, request_id: str) -> None:
        self.log.append(f"abort {request_id} before step {self.steps}")
        del self.running[request_id]

    def vllm_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        self.closed = True


def run(tmp_path, scenario: str, engine: FakeEngine | None = None):
    path = tmp_path / "s.yaml"
    path.write_text("engine: {block_size: 16}\n" + textwrap.dedent(scenario))
    engine = engine or FakeEngine()
    result = replay(compile_scenario(path), engine)
    return result, {r.id: r for r in result.requests}, engine


def test_arrival_step_enters_before_that_step_and_idle_time_is_skipped(tmp_path):
    result, r, engine = run(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}, output_len: 2}
          - {id: b, arrival_step: 500, prompt: {stream: s, len: 20}, output_len: 3}
        """)
    assert engine.log == ["add a before step 0", "add b before step 2"]
    assert r["b"].arrival_step == 500                  # the clock jumped, the engine did not
    assert (r["b"].prefill_step, r["b"].finish_step) == (500, 502)
    assert result.steps == 5 and not engine.closed      # the caller owns the engine


def test_after_enters_once_its_request_finished_before_the_next_step(tmp_path):
    _, r, engine = run(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}, output_len: 3}
          - {id: b, after: a, prompt: {stream: s, len: 20}}
          - {id: c, arrival_step: 1, prompt: {stream: t, len: 20}, output_len: 5}
        """)
    assert r["a"].finish_step == 2
    assert r["b"].arrival_step == 3 == r["b"].prefill_step
    assert engine.log == ["add a before step 0", "add c before step 1", "add b before step 3"]


def test_event_after_runs_before_the_requests_that_follow_the_same_request(tmp_path):
    _, r, engine = run(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}, output_len: 2}
          - {id: b, after: a, prompt: {stream: s, len: 20}}
        events:
          - {after: a, action: reset_prefix_cache}
        """)
    assert engine.log == ["add a before step 0", "reset before step 2", "add b before step 2"]


def test_at_step_event_runs_before_that_step_and_before_its_arrivals(tmp_path):
    _, r, engine = run(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}, output_len: 6}
          - {id: b, arrival_step: 3, prompt: {stream: s, len: 20}}
        events:
          - {at_step: 3, action: reset_prefix_cache}
        """)
    assert engine.log == ["add a before step 0", "reset before step 3", "add b before step 3"]


def test_at_step_event_on_an_idle_engine_makes_the_clock_stop_there(tmp_path):
    _, r, engine = run(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}}
          - {id: b, arrival_step: 50, prompt: {stream: s, len: 20}}
        events:
          - {at_step: 20, action: reset_prefix_cache}
        """)
    assert engine.log == ["add a before step 0", "reset before step 1", "add b before step 1"]
    assert r["b"].arrival_step == 50


def test_one_point_of_the_clock_follows_trace_row_order(tmp_path):
    result, _, engine = run(tmp_path, """\
        requests:
          - {id: z, arrival_step: 2, prompt: {stream: s, len: 20}}
          - {id: y, prompt: {stream: s, len: 20}}
          - {id: x, arrival_step: 2, prompt: {stream: s, len: 20}}
          - {id: w, prompt: {stream: s, len: 20}}
        """)
    assert [r.id for r in result.requests] == ["y", "w", "z", "x"]


def test_abort_event_ends_a_running_request_and_frees_its_followers_never(tmp_path):
    with pytest.raises(ReplayError, match=r"requests never arrived: \['after_long'\]"):
        run(tmp_path, """\
            requests:
              - {id: long, prompt: {stream: s, len: 20}, output_len: 10}
              - {id: after_long, after: long, prompt: {stream: s, len: 20}}
            events:
              - {at_step: 3, action: abort, target: long}
            """)


def test_abort_event_marks_the_request(tmp_path):
    _, r, engine = run(tmp_path, """\
        requests:
          - {id: long, prompt: {stream: s, len: 20}, output_len: 10}
          - {id: short, prompt: {stream: t, len: 20}, output_len: 5}
        events:
          - {at_step: 3, action: abort, target: long}
        """)
    assert r["long"].aborted and r["long"].finish_step == 3
    assert not r["short"].aborted and r["short"].finish_step == 4
    assert "abort long before step 3" in engine.log


def test_abort_of_a_request_not_yet_arrived_is_an_error(tmp_path):
    with pytest.raises(ReplayError, match=r"event abort \(at_step 1\) at step 1: request 'b' "
                                          "has not arrived yet"):
        run(tmp_path, """\
            requests:
              - {id: a, prompt: {stream: s, len: 20}, output_len: 5}
              - {id: b, arrival_step: 4, prompt: {stream: s, len: 20}}
            events:
              - {at_step: 1, action: abort, target: b}
            """)


def test_an_engine_that_never_schedules_stops_the_replay(tmp_path):
    engine = FakeEngine(stuck=True)
    with pytest.raises(ReplayError, match=f"no progress for {MAX_IDLE_STEPS} steps"):
        run(tmp_path, """\
            requests:
              - {id: a, prompt: {stream: s, len: 20}}
            """, engine)
    assert engine.steps == MAX_IDLE_STEPS


def test_requests_that_compute_but_never_finish_stop_the_replay(tmp_path):
    """A preemption loop (steps run, nothing finishes) ends in an error, not a hang."""
    engine = FakeEngine(thrashing=True)
    with pytest.raises(ReplayError, match=r"no request finished in \d+ steps .*\['a', 'b'\] "
                                          "keep being preempted"):
        run(tmp_path, """\
            requests:
              - {id: a, prompt: {stream: s, len: 20}}
              - {id: b, prompt: {stream: t, len: 30}}
            """, engine)
    assert engine.steps == MIN_STUCK_STEPS


def test_a_long_request_is_not_taken_for_a_stuck_one(tmp_path):
    """Steps without a finish are fine while the live requests have tokens left."""
    _, r, engine = run(tmp_path, f"""\
        requests:
          - {{id: long, prompt: {{stream: s, len: 20}}, output_len: {MIN_STUCK_STEPS + 50}}}
        """)
    assert r["long"].finish_step == MIN_STUCK_STEPS + 49


def test_schedule_hands_out_each_arrival_and_event_once():
    sched = Schedule([0, None, 3, 3], [None, "r0", None, None],
                     [{"after": None, "at_step": 3, "action": "abort", "target": "r2"},
                      {"after": "r0", "at_step": None, "action": "reset_prefix_cache"}])
    assert sched.events_due(0) == [] and sched.arrivals_due(0) == [0]
    assert sched.next_point() == 3
    events, rows = sched.after("r0")
    assert [e.action for e in events] == ["reset_prefix_cache"] and rows == [1]
    assert [e.why for e in sched.events_due(10)] == ["at_step 3"]
    assert sched.arrivals_due(10) == [2, 3]
    assert sched.next_point() is None and sched.arrivals_due(11) == []


def test_arrivals_far_in_the_future_and_none_left():
    """The next arrival is held as a plain number: steps past 2**62 still come in
    order, and a schedule with no timed arrival (or none left) hands out none."""
    far = 2**62 + 5
    sched = Schedule([far, 7, far + 1], [None, None, None])
    assert sched.arrivals_due(6) == [] and sched.arrivals_due(7) == [1]
    assert sched.arrivals_due(2**62) == [] and sched.next_point() == far
    assert sched.arrivals_due(far) == [0] and sched.arrivals_due(far) == []
    assert sched.arrivals_due(2**63 - 1) == [2] and sched.next_point() is None
    assert Schedule([None], ["x"]).arrivals_due(2**63 - 1) == []
