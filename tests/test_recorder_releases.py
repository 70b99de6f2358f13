"""The recorder on every release the replay runs, and on versions no test has seen.

The server checks, when it starts, every vLLM name the recorder's hooks use
(replayer/recorder/hooks.py). Here a replay recorded on the first release of
the older adapter's range (0.29.0) and on 0.34.0 (an adapter of its own), the
store connector included, runs that check and round-trips through `check
--against recorded` on that release; the check runs on its own inside the
others (0.30.0-0.32.0, from the wheel cache) and inside a tree with one hook
renamed; 0.33.0 records in test_recorder_roundtrip.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STORE_SCENARIOS, cli
from replayer.replay.engines.sources.releases import KNOWN_RELEASES
from replayer.replay.engines.sources.specs import resolve
from replayer.replay.execution.environment import engine_env, write_overlay
from replayer.recorder import releases

RESEND = STORE_SCENARIOS / "resend_after_reset.yaml"
SCHEDULER = Path("v1") / "core" / "sched" / "scheduler.py"

CHECK = """
import json, vllm
from replayer.recorder import releases
try:
    adapter = releases.check_release(vllm.__version__, connector=True).__name__
except RuntimeError as exc:
    adapter = "REFUSED " + str(exc)
print(json.dumps({"version": vllm.__version__, "adapter": adapter}))
"""


def check_in(spec: str, tmp_path: Path) -> dict:
    """The recorder's release check, run where ``spec``'s vLLM is the one imported."""
    engine = resolve(spec)
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    write_overlay(engine, overlay)
    env = engine_env(engine, overlay, base={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR",
                                            "PYTHONDONTWRITEBYTECODE": "1"})
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# A recording through the store connector runs the same check where it starts
# (replayer.recorder.connector): 0.29.0 (the 0.29 adapter's first) and 0.34.0 (its
# own adapter's) below, 0.33.0 in test_recorder_roundtrip.py. The others are
# checked here on their own (0.32.0 recorded here until 0.34.0 took its place).
RECORDED_HERE = ("0.29.0", "0.34.0")


# The replay runs 0.26-0.28 too; the recorder hooks from 0.29 on.
RECORDED_RELEASES = tuple(v for v in KNOWN_RELEASES if v >= "0.29")


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in RECORDED_RELEASES
                                     if v not in (*RECORDED_HERE, "0.33.0")])
def test_every_hook_is_there_in_each_release_no_recording_test_runs(version, tmp_path):
    got = check_in(f"vllm=={version}", tmp_path)
    want = releases.adapter_name(version)
    assert want == {"0.33": "replayer.recorder.vllm_0_33", "0.34": "replayer.recorder.vllm_0_34"
                    }.get(version[:4], "replayer.recorder.vllm_0_29")
    assert got == {"version": version, "adapter": want}


def tree_without_free_request(tmp_path: Path) -> Path:
    """0.33.0's package with ``Scheduler._free_request`` renamed: every entry a link
    to the release's, but the directories down to the scheduler module, which is a
    copy (no bytecode is linked where a source changed)."""
    src = resolve("vllm==0.33.0").sources
    assert src is not None
    src, tree = Path(src), tmp_path / "tree" / "vllm"
    here, there = tree, src
    for part in SCHEDULER.parts:
        here.mkdir(parents=True)
        for entry in there.iterdir():
            if entry.name not in (part, "__pycache__"):
                (here / entry.name).symlink_to(entry)
        here, there = here / part, there / part
    text = there.read_text()
    assert text.count("def _free_request(") == 1
    here.write_text(text.replace("def _free_request(", "def _free_request_renamed("))
    return tree


@pytest.mark.slow
def test_a_tree_missing_one_hook_is_refused_naming_it(tmp_path):
    got = check_in(str(tree_without_free_request(tmp_path)), tmp_path)
    assert got["version"] == "0.33.0"
    assert got["adapter"] == (
        "REFUSED prefix-replayer recorder: vLLM 0.33.0 lacks "
        "vllm.v1.core.sched.scheduler.Scheduler._free_request, which the recorder hooks; "
        f"unset {releases.RECORD_ENV} (and recorder_dir) to serve without recording")


@pytest.mark.parametrize("version, adapter", [
    ("0.33.1.dev5+g0123abc", "vllm_0_33"),      # a nightly
    ("0.33.0+local", "vllm_0_33"),             # a fork's build
    ("0.31.1", "vllm_0_29"),                   # a patch release no test has seen
])
def test_a_version_no_test_has_seen_records_with_one_warning(version, adapter, caplog):
    releases._WARNED.discard(version)
    with caplog.at_level(logging.WARNING, logger="vllm.prefix_replayer"):
        module = releases.check_release(version)
        releases.check_release(version)          # said once per process
    assert module.__name__ == f"replayer.recorder.{adapter}"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"prefix-replayer recorder: vLLM {version} is not a release the recorder "
                     "is tested on (0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0); every hook it "
                     "uses is there, so it records (the trace's header names the version "
                     "and commit)"]


# In this process (the installed 0.33): the releases whose names it has. 0.34's
# adapter reads names 0.34 renamed (test_every_hook_is_there_... checks them there).
@pytest.mark.parametrize("version", [*(v for v in RECORDED_RELEASES if v < "0.34"),
                                     "0.32.0+cpu"])
def test_a_tested_release_records_without_a_warning(version, caplog):
    releases._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.prefix_replayer"):
        releases.check_release(version)
    assert caplog.records == []


@pytest.mark.parametrize("version, why", [
    ("0.28.2", "is older than 0.29, the oldest release the recorder hooks"),
    ("main", "is not a release number the recorder can read"),
])
def test_a_version_the_recorder_cannot_serve_is_refused_in_one_line(version, why):
    with pytest.raises(RuntimeError) as info:
        releases.check_release(version)
    assert str(info.value) == (f"prefix-replayer recorder: vLLM {version} {why}; unset "
                               "PREFIX_REPLAYER_RECORD_DIR (and recorder_dir) to serve "
                               "without recording")


def test_the_tested_releases_are_the_ones_the_replay_runs_from_0_29():
    assert releases.TESTED_RELEASES == RECORDED_RELEASES


@pytest.mark.slow
@pytest.mark.parametrize("version", RECORDED_HERE)
def test_a_recording_on_a_release_round_trips_with_its_store_ops(version, tmp_path):
    """#56615's resends through the MooncakeStore connector, recorded on the release
    (keys, lookups and the reset included), then `check --against recorded` there.
    The first release of the 0.29 adapter and 0.34, whose adapter reads rows by
    req_ids and prefix_cache_hit_limit (EAGLE here: the accepted drafts go through
    it); the releases between have each hook checked above, ~50 s a round trip saved."""
    from traces.trace import read_trace

    from replayer.check import recorded as fidelity
    from replayer.replay.store import StoreSpec
    from traces import load_target

    rec = tmp_path / "rec"
    trace = load_target(RESEND)
    fidelity.record_replay(trace, rec, store=StoreSpec("memory"), spec=f"vllm=={version}")
    recorded = read_trace(rec)
    assert recorded.header["source"]["vllm"] == version
    ops = recorded.store_ops
    assert ops is not None and {"lookup", "put"} <= set(ops["op"].to_pylist())
    proc = cli("check", "--against", "recorded", rec, "--engine", f"vllm=={version}",
               "--store", "memory", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.rmtree(rec)
