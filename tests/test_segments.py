"""Time segments (``--segments K``): the output is the sequential replay's, byte for byte.

Every identity test replays in this process (:class:`InProcessHost`: the same
workers and head as a pool or Ray, without their interpreters), over the
recorded fixtures and a slice of the conversation trace, for K from 2 to 8,
with a warm-up long enough that boundaries match and one so short that every
boundary fails (each segment is then replayed again from its predecessor).
Equal ``--json`` bytes, and equal engine-step and lookup numbers (what
``explain`` reads beside them), are the assertion.
"""

from __future__ import annotations

import json

import pytest

from conftest import MOONCAKE_TRACE, REPO, TRACES, cli, cli_here
from helpers_segments import release_split
from replayer.check.output import dumps
from replayer.replay.segments import plan_segments, replay_segments, warm_up_steps, why_serial
from replayer.replay.segments.hosts import InProcessHost
from replayer.replay.segments.plan import work_by_step
from traces import TraceError, load_target

_SEQUENTIAL: dict[str, object] = {}


def _trace(name: str):
    if name == "conv120":
        from traces.importers.mooncake import import_mooncake

        return import_mooncake(MOONCAKE_TRACE, limit=120)
    return load_target(TRACES / name)


def _sequential(name: str, trace):
    from replayer.replay.execution.clients import replay_on

    if name not in _SEQUENTIAL:
        _SEQUENTIAL[name] = replay_on(trace)
    return _SEQUENTIAL[name]


def _assert_same(seq, res) -> None:
    assert dumps(res) == dumps(seq)
    assert res.finished_engine_step == seq.finished_engine_step
    assert res.lookups == seq.lookups


# (fixture, K, warm-up): K from 2 to 8 on the recorded EAGLE fixture (cheap: 267
# steps; 2, 5 and 8, each K between costs the suite as much and tests the
# same; K 3 on it is below, on the installed vLLM with Ray and on 0.31.0), the
# others at a few K; "1steps" is a warm-up so short every boundary fails. The
# fallback path (every boundary failed) runs on a recording (live_eagle), a hybrid
# (live_qwen3_next) and an imported trace (conv120); live_llama's 250 requests
# through it (K 3) tested the same path again at the price of two more replays.
CASES = [("live_eagle", k, "50steps") for k in (2, 5, 8)] + [
    ("live_eagle", 5, "1steps"),
    ("live_qwen3_next", 3, "20steps"),        # hybrid: three Mamba groups and attention
    ("live_qwen3_next", 2, "1steps"),
    ("conv120", 2, "30s"),
    ("conv120", 7, "30s"),
    ("conv120", 3, "1steps"),
]
# Where the warm-up is long enough that boundaries match (the proof path, not
# only the fallback): how many of them.
FEWER = {("conv120", 7, "30s"): 6}
MATCHES = {("live_eagle", 8, "50steps"): 7, ("conv120", 7, "30s"): 1}


@pytest.mark.slow
@pytest.mark.parametrize("name,k,warm", CASES, ids=[f"{n}-K{k}-{w}" for n, k, w in CASES])
def test_segments_replay_byte_identical(name, k, warm):
    trace = _trace(name)
    seq = _sequential(name, trace)
    res, report = replay_segments(trace, InProcessHost(), k, warm_up_steps(warm, trace), warm)
    _assert_same(seq, res)
    # Fewer where a warm-up longer than the trace's gaps makes more segments no
    # faster (said on stderr as "of K asked").
    assert len(report.plan.segments) == FEWER.get((name, k, warm), k)
    assert len(report.checks) == len(report.plan.segments) - 1
    if warm == "1steps":
        assert report.matched == [], "a one-step warm-up cannot reach the true state"
    if (name, k, warm) in MATCHES:
        assert len(report.matched) == MATCHES[name, k, warm]
    for check in report.checks:      # a verdict is the digests' equality, nothing else
        assert check.matched == (check.started is not None
                                 and check.started["total"] == check.exact["total"])


@pytest.mark.slow
def test_a_release_splits_with_the_sequential_bytes():
    """vLLM 0.31.0 (a release, not the installed vLLM): its segments run in a process
    of their own that imports it (one, --jobs 1), its boundaries proven by the
    0.29-0.32 digest; both match at a 50-step warm-up and the bytes are the
    sequential replay's on that release."""
    res, report, seq, kind = release_split("vllm==0.31.0")
    assert res.engine.vllm == "0.31.0" and kind == "release processes"
    _assert_same(seq, res)
    assert report.matched == [1, 2]


@pytest.mark.slow
def test_physical_block_ids_change_nothing():
    """The digest leaves physical block ids out because no decision depends on them:
    a replay over a permuted pool gives the same bytes, and the same digest at a
    boundary, as one over vLLM's own order."""
    import random

    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    from replayer.replay.engines.digest.release_0_33 import state_digest
    from replayer.replay.execution.in_process import engine_here
    from replayer.replay.loop import ReplayRun

    trace = _trace("live_eagle")
    outs = []
    for permute in (False, True):
        with engine_here(trace) as engine:
            pool = engine.scheduler.kv_cache_manager.block_pool
            if permute:
                blocks = [b for b in pool.blocks if not b.is_null]
                random.Random(7).shuffle(blocks)
                pool.free_block_queue = FreeKVCacheBlockQueue(blocks)
            run = ReplayRun(trace, engine)
            assert run.run_to(150)
            digest = state_digest(engine, {"clock": run.clock})
            ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()[:50]]
            run.run_to(None)
            outs.append((digest, dumps(run.result()), ids))
    assert outs[0][2] != outs[1][2]                 # the pools did differ
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["history", "unencodable"])
def test_a_field_the_digest_was_not_told_of_fails_the_boundary(monkeypatch, plant):
    """The digest walks vLLM's objects by structure: a field added to a manager
    mid-replay is in it unasked. One whose value depends on the replay's history
    differs at the boundary; one of a type the digest cannot encode is an error,
    said once, and the boundary is not trusted. Without the plant, both boundaries
    of live_eagle at K 3 match (test_ray_gives_the_sequential_bytes)."""
    import functools

    from replayer.replay.segments import worker as segment_worker

    real = segment_worker.SegmentWorker._boundary

    def planted(self, point):
        group = self._engine.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        group.planted = (self._run.steps_run if plant == "history"
                         else functools.partial(max, point))
        return real(self, point)

    monkeypatch.setattr(segment_worker.SegmentWorker, "_boundary", planted)
    trace = _trace("live_eagle")
    said: list[str] = []
    res, report = replay_segments(trace, InProcessHost(), 3, 50, say=said.append)
    _assert_same(_sequential("live_eagle", trace), res)
    assert len(report.checks) == 2 and report.matched == []
    if plant == "history":
        assert all(c.exact["kv_managers"] != c.started["kv_managers"] for c in report.checks)
        assert all(c.exact["requests"] == c.started["requests"] for c in report.checks)
    else:
        assert all(c.exact is None and c.started is None for c in report.checks)
        reason = [line for line in said if "cannot be taken" in line]
        assert reason == ["the state digest cannot be taken (single_type_managers[0].planted: "
                          "a functools.partial, which the state digest cannot encode): a "
                          "boundary where it cannot is never trusted"]
        assert all("functools.partial" in c.note for c in report.checks)


@pytest.mark.slow
def test_explain_over_segments_is_explain():
    from replayer.analysis.explain import explain
    from replayer.replay.execution.clients import replay_on

    trace = _trace("live_eagle")
    host = InProcessHost()
    plain = explain(trace, run=replay_on)
    seg = explain(trace, run=lambda t: replay_segments(t, host, 3, 50)[0])
    assert seg.dumps() == plain.dumps()
    # The command line's explain --segments (in its own process, one after another).
    proc = cli("explain", TRACES / "live_eagle", "--segments", "3", "--warm-up", "50steps",
               "--jobs", "1", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith(plain.dumps())
    assert "replayer: segments: replay 1: boundaries matched: 2 of 2" in proc.stderr


@pytest.mark.slow
def test_ray_gives_the_sequential_bytes():
    """The segments on Ray (one actor: both segments, one after another); the
    local pool is the command line's default, below."""
    import ray                  # the ray extra: make test installs it; missing is a failure

    from replayer.replay.segments.hosts import RayHost

    trace = _trace("live_eagle")
    seq = _sequential("live_eagle", trace)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    try:
        host = RayHost("auto", 2)
        try:
            res, report = replay_segments(trace, host, 3, 50)
        finally:
            host.close()
    finally:
        ray.shutdown()
    _assert_same(seq, res)
    assert host.slots == 1 and report.matched == [1, 2]


@pytest.mark.slow
def test_cli_run_segments_says_and_writes_digests(tmp_path):
    out = tmp_path / "seg.json"
    proc = cli("run", TRACES / "live_eagle", "--segments", "2", "--warm-up", "50steps",
               "--json", out, "--segment-digests", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "replayer: segments: 2 segments at steps 161, warm-up 50steps (50 steps), " \
           "on a local process pool of 2" in proc.stderr
    assert "boundaries matched: 1 of 1; replayed again from the segment before: none" \
        in proc.stderr
    assert "seconds per segment (start-up + warm-up + own range + finishing): 0: " \
        in proc.stderr
    data = json.loads(out.read_text())
    [boundary] = data["segments"]["boundaries"]
    assert boundary["matched"] and boundary["exact"] == boundary["segment_started"]
    assert set(boundary["exact"]) >= {"queues", "requests", "prefix_cache", "blocks", "total"}
    seq = _sequential("live_eagle", _trace("live_eagle"))
    del data["segments"]
    assert json.dumps(data, indent=2) + "\n" == dumps(seq)


@pytest.mark.slow
def test_time_paused_between_calls_is_no_replays():
    """A worker waits, paused, for the head's next call: those seconds are not its
    replay's (counted in, they made the exact path's own time, hence the speed-up
    said, larger than it was wherever a boundary failed)."""
    import time

    from replayer.replay.segments.plan import Segment
    from replayer.replay.segments.worker import SegmentWorker, trace_part

    trace = _trace("live_eagle")
    seg = Segment(0, 0, 161, 0)
    worker = SegmentWorker(seg, trace_part(trace, seg, trace.sized_engine()))
    try:
        assert worker.begin()["start"] is None          # the first segment: no start digest
        assert worker.run_on()["end"].point == 161
        time.sleep(2.5)
        rest = worker.extend(None)                      # the other ~100 steps: well under 1 s
        assert rest["ended"] and rest["seconds"] < 2.5
        time.sleep(2.5)
        assert worker.finish().seconds < 2.5
    finally:
        worker.close()


def test_plan_balances_work_and_starts_at_arrivals():
    trace = _trace("conv120")
    points, work = work_by_step(trace)
    plan = plan_segments(trace, 4, warm_up_steps("10s", trace))
    assert len(plan.segments) == 4
    assert all(b in set(points.tolist()) for b in plan.boundaries)
    assert plan.segments[0].warm_from == 0
    assert all(s.warm_from == max(0, s.start - 500) for s in plan.segments[1:])
    # Each segment's estimated work, warm-up included, within 25% of the mean.
    mean = sum(plan.estimated_work) / 4
    assert max(abs(w - mean) for w in plan.estimated_work) < 0.25 * mean
    # More segments than arrival steps: as many as there are.
    assert len(plan_segments(_trace("live_qwen3_next"), 500, 1).segments) <= 40


def test_warm_up_durations():
    trace = _trace("conv120")            # 20 ms a step
    assert warm_up_steps("2m", trace) == 6000
    assert warm_up_steps("90s", trace) == 4500
    assert warm_up_steps("500ms", trace) == 25
    assert warm_up_steps("3000steps", trace) == 3000
    with pytest.raises(TraceError, match="not a duration"):
        warm_up_steps("two minutes", trace)


def test_what_stays_in_one_piece():
    from conftest import SCENARIOS
    from traces import load_target as load

    assert why_serial(_trace("live_eagle")) is None
    assert "after:" in why_serial(load(SCENARIOS / "shared_system_prompt_hybrid.yaml"))
    assert why_serial(load(TRACES / "live_store_llama")) is None     # tests/test_segments_store.py
    assert why_serial(load(TRACES / "live_qwen3_next_kv_events")) is None


def test_cli_segment_options_are_checked():
    proc = cli_here("run", TRACES / "live_eagle", "--segments", "0")
    assert proc.returncode == 2 and "--segments: must be at least 1" in proc.stderr
    proc = cli_here("run", TRACES / "live_eagle", "--segments", "2", "--warm-up", "soon")
    assert proc.returncode == 2 and "'soon' is not a duration" in proc.stderr
    # The model worker's runner state is not in the digest: refused, not run unproven.
    import argparse

    from replayer.cli.segmented import check_segment_opts

    with pytest.raises(TraceError, match="--segments: not with --worker model"):
        check_segment_opts(argparse.Namespace(segments=2, jobs=None, worker="model"))
    check_segment_opts(argparse.Namespace(segments=1, jobs=None, worker="model"))
    # A release's segments import it in processes started here: not on Ray's actors.
    from replayer.replay.engines.sources.specs import resolve
    from replayer.replay.segments.hosts import make_host

    with pytest.raises(TraceError, match="--ray: not with vllm 0.31.0"):
        make_host("local", None, 2, engine=resolve("vllm==0.31.0"))


def test_shrink_splits_only_its_long_probes():
    """shrink --segments: a probe of LONG_PROBE_REQUESTS requests or more replays in
    segments, a shorter one (or one asked for more than its trace) through the
    engine's client; the shrink's options are checked like run's."""
    from types import SimpleNamespace

    from replayer.cli.segmented import LONG_PROBE_REQUESTS, SegmentedClient

    calls: list[tuple[str, int]] = []

    class Client:
        info, in_process, parallel = "engine", False, True

        def __call__(self, trace, **kw):
            calls.append(("client", trace.requests.num_rows))
            return "whole"

        def replay_many(self, traces, store=None):
            return [self(t) for t in traces]

        def close(self):
            calls.append(("closed", 0))

    def runner(trace, label=None):
        calls.append(("segments", trace.requests.num_rows))
        return "split"

    runner.close = lambda: calls.append(("runner closed", 0))
    seg = SegmentedClient(Client(), runner)

    def trace(n):
        return SimpleNamespace(requests=SimpleNamespace(num_rows=n))

    long, short = trace(LONG_PROBE_REQUESTS), trace(LONG_PROBE_REQUESTS - 1)
    assert seg(long) == "split" and seg(short) == "whole"
    assert seg(long, store="s") == "whole"
    assert seg.replay_many([short, short]) == ["whole", "whole"]
    assert seg.replay_many([short, long]) == ["whole", "split"]
    seg.close()
    n = LONG_PROBE_REQUESTS
    assert calls == [("segments", n), ("client", n - 1), ("client", n), ("client", n - 1),
                     ("client", n - 1), ("client", n - 1), ("segments", n),
                     ("runner closed", 0), ("closed", 0)]
    proc = cli_here("shrink", TRACES / "live_eagle", "-o", "/dev/null", "--diff", "installed",
                    "installed", "--segments", "0")
    assert proc.returncode == 2 and "--segments: must be at least 1" in proc.stderr


def test_pool_processes_fork_from_one_server_that_imported_vllm(monkeypatch):
    """The pool's processes fork from a server preloading vLLM (one import for them
    all); a pool at another log level than that server's spawns its own."""
    from replayer.replay.segments import hosts

    monkeypatch.setattr(hosts, "_FORK_SERVER_VERBOSE", [])
    ctx = hosts._pool_context(False)
    assert ctx.get_start_method() == "forkserver"
    from multiprocessing import forkserver

    assert "replayer.replay.segments.preload" in forkserver._forkserver._preload_modules
    assert hosts._pool_context(False).get_start_method() == "forkserver"
    assert hosts._pool_context(True).get_start_method() == "spawn"


def test_a_pool_process_ends_when_its_head_is_killed():
    """A head killed by a signal never closes its pool: its processes (and the fork
    server) watch it and end within about a second (they replayed on for nobody)."""
    import subprocess
    import sys
    import time

    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\n"
                               "from replayer.replay.segments.hosts import exit_when_gone\n"
                               f"exit_when_gone({head.pid})\n"
                               "time.sleep(60)\n"], cwd=str(REPO))
    try:
        time.sleep(1.5)
        assert worker.poll() is None, "the worker ended while its head was alive"
        head.kill()
        head.wait()
        assert worker.wait(timeout=10) == 1
    finally:
        for p in (head, worker):
            if p.poll() is None:
                p.kill()
