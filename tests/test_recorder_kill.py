"""A recording killed with SIGKILL mid-run: every request that had arrived by the
last flush is in the trace, the ones still running end where the recording
ended, the replay reproduces what was recorded before the kill, and
``check --against recorded`` passes on what the recording holds whole."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from traces import load_target
from traces.trace import read_trace

from conftest import REPO

SOURCE = REPO / "fixtures" / "traces" / "conversation_500"
RECORD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from traces import load_target
    from replayer.check import recorded as fidelity
    fidelity.record_replay(load_target({src!r}), {out!r})
""")


def _parts(folder):
    return list(folder.glob("part-*.parquet")) if folder.is_dir() else []


def _running(out) -> int:
    """Requests the recording so far shows arrived but not finished."""
    if len(_parts(out / "requests")) < 2 or len(_parts(out / "outcomes")) < 2:
        return 0
    events = read_trace(out).events
    return 0 if events is None else sum(a == "abort" for a in events["action"].to_pylist())


def test_kill_9_mid_recording_keeps_running_requests_and_replays(tmp_path):
    out = tmp_path / "rec"
    env = {**os.environ, "PREFIX_REPLAYER_RECORD_FLUSH_SECONDS": "0.3",
           "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen([sys.executable, "-c",
                             RECORD.format(repo=str(REPO), src=str(SOURCE), out=str(out))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        # Kill once the parts on disk show several requests still running (a
        # fixed delay could land in a lull when every arrival has finished).
        # The recorder is stopped (SIGSTOP) while its parts are read, so the
        # state looked at is the state the kill leaves: read while it ran, a
        # flush could land the running requests' outcomes between the look and
        # the kill.
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"recording ended before the kill: {proc.stderr.read()}")
            assert time.monotonic() < deadline, "no parts written within 300 s"
            os.kill(proc.pid, signal.SIGSTOP)
            if _running(out) >= 5:
                break
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    trace = read_trace(out)
    source = load_target(SOURCE)
    n = trace.requests.num_rows
    assert 0 < n < source.requests.num_rows
    # Arrivals are written in order: the recorded ones are the source's first n.
    assert trace.requests["id"].to_pylist() == source.requests["id"].to_pylist()[:n]
    running = [e["target"] for e in trace.events.to_pylist() if e["action"] == "abort"]
    assert running, "the kill left no request running"
    assert any("still running when the recording ended" in note for note in trace.notes)

    from replayer.replay.execution.clients import replay_on

    replayed = {r.id: r.as_dict() for r in replay_on(trace).requests}
    assert set(replayed) == set(trace.requests["id"].to_pylist())
    # A request first scheduled before the last recorded arrival cannot have been
    # influenced by a request the kill lost: its recorded outcome must replay.
    last_arrival = max(trace.requests["arrival_step"].to_pylist())
    first_step: dict[str, int] = {}
    for row in trace.steps.to_pylist():
        first_step.setdefault(row["id"], row["step"])
    compared = 0
    for row in trace.outcomes.to_pylist():
        if first_step.get(row["id"], last_arrival) < last_arrival:
            assert replayed[row["id"]]["num_cached_tokens"] == row["num_cached_tokens"], row
            compared += 1
    assert compared >= 10

    from replayer.check.recorded import check_against_recorded

    # The check compares what the recording holds whole, up to the step every
    # table had on disk, and says in one line how many requests it left out.
    assert trace.cut_step is not None and trace.cut_step <= max(trace.steps["step"].to_pylist())
    lines, ok, _ = check_against_recorded(trace)
    assert ok, "\n".join(lines)
    assert lines[0].startswith("replay matches the recording: ")
    assert lines[0].endswith(f" up to step {trace.cut_step}")
    assert len(lines) == 2 and lines[1].startswith(
        f"the recording was cut short (no clean stop) after step {trace.cut_step}: ")
    counts = re.match(r".*: (\d+) request\(s\) not compared, prefilled after it or with rows "
                      r"lost.*; (\d+) more still running, compared up to it$", lines[1])
    assert counts, lines[1]
    assert int(counts.group(1)) + int(counts.group(2)) >= len(running)
