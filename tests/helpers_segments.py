"""Helpers shared by the time-segment tests: the waves traces of
tests/test_segments_store.py and tests/test_segments_offload.py, and a release's
split of the recorded EAGLE fixture or another trace (tests/test_segments.py,
test_release_0_34.py)."""

from __future__ import annotations

import pytest

from traces import load_target

WAVES = 8
ENGINE = ("engine:\n  block_size: 16\n  num_gpu_blocks: 64\n"
          "  max_num_batched_tokens: 2048\n  max_num_seqs: 4\n")


def waves_scenario(path, connector: str, last=None, more: tuple[str, ...] = ()):
    """Waves of requests 40 steps apart, written to ``path`` and loaded: each wave
    sends a new prompt, resends the one before, resets the GPU cache, resends its
    own, resends the prompt of three waves ago, and resets again (so at a boundary
    the GPU side is empty and only the connector's side can tell two paths apart).
    ``connector``: the engine block's lines after the shared ones; ``last``: one
    more request ``(id, arrival step, stream)`` after the waves; ``more``: request
    lines (YAML flow mappings) after that."""
    reqs, events = [], []

    def req(rid, at, stream):
        reqs.append(f"  - {{id: {rid}, arrival_step: {at}, output_len: 2, "
                    f"prompt: [{{stream: s{stream}, len: 256}}]}}")
    for j in range(WAVES):
        t = 40 * j
        req(f"n{j}", t, j)
        if j >= 1:
            req(f"q{j}", t + 8, j - 1)
        events.append(f"  - {{at_step: {t + 18}, action: reset_prefix_cache}}")
        req(f"r{j}", t + 20, j)
        if j >= 3:
            req(f"o{j}", t + 28, j - 3)
        events.append(f"  - {{at_step: {t + 38}, action: reset_prefix_cache}}")
    if last is not None:
        req(*last)
    reqs += [f"  - {line}" for line in more]
    path.write_text(ENGINE + connector + "requests:\n" + "\n".join(reqs)
                    + "\nevents:\n" + "\n".join(events) + "\n")
    return load_target(path)


def waves_fixture(folder: str, name: str, connector: str, last=None,
                  more: tuple[str, ...] = ()):
    """A module-scoped ``waves`` fixture: (the waves trace, its sequential replay)."""

    @pytest.fixture(scope="module")
    def waves(tmp_path_factory):
        from replayer.replay.execution.clients import replay_on

        trace = waves_scenario(tmp_path_factory.mktemp(folder) / name, connector, last, more)
        return trace, replay_on(trace)

    return waves


def release_split(version: str, trace=None, warm_up: int = 50):
    """``trace`` (the recorded EAGLE fixture, live_eagle, by default) on release
    ``version`` at K 3 with a ``warm_up``-step warm-up, its segments in one process
    of their own that imports it (--jobs 1): (the segments' result, their report,
    the sequential replay on that release, the host's kind)."""
    from conftest import TRACES
    from replayer.replay.engines.sources.specs import resolve
    from replayer.replay.execution.clients import replay_on
    from replayer.replay.segments import replay_segments
    from replayer.replay.segments.hosts import make_host

    if trace is None:
        trace = load_target(TRACES / "live_eagle")
    engine = resolve(version)
    seq = replay_on(trace, engine)
    host = make_host(None, 1, 3, engine=engine)
    try:
        res, report = replay_segments(trace, host, 3, warm_up, spec=engine)
    finally:
        host.close()
    return res, report, seq, host.kind


def assert_waves_split(res, report, seq, section: str) -> None:
    """The waves' split at K 3 with a 110-step warm-up: boundaries at 180 and 260,
    180 matches, 260 differs in ``section`` alone (and the total) and the segment
    before replays on; the --json bytes are the sequential replay's."""
    from replayer.check.output import dumps

    assert report.plan.boundaries == [180, 260]
    assert report.matched == [1]
    failed = report.checks[1]
    assert {k for k in failed.exact if failed.exact[k] != failed.started[k]} == {section, "total"}
    assert dumps(res) == dumps(seq)
