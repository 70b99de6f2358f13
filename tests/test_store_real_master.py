"""MooncakeStore replay against a real ``mooncake_master`` on loopback.

These start the master the CI installs (mooncake-transfer-engine-non-cuda).
They never skip: without a master they fail. CI runs them inside a private
network namespace, so nothing listens beyond the test.
"""

from __future__ import annotations

import os

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, STORE_SCENARIOS, cli
from replayer.check.goldens import observed
from replayer.compare.workers import worker_differences
from replayer.replay.engines.sources.specs import parse_spec, resolve
from replayer.replay.execution.clients import cold_client
from replayer.replay.execution.clients import replay_on as replay
from replayer.replay.store import StoreSpec
from replayer.replay.store.master import MasterProcess
from traces import load_target
from traces.goldens.outcomes import compare, select
from traces.goldens.store import STORE, compare_store

pytestmark = pytest.mark.real_master

# A fixture that sizes its store (engine.mooncake_global_segment_size) is about
# the memory store's evictions; a real master refuses it (test below).
SIZED = [p for p in sorted(STORE_SCENARIOS.glob("*.yaml"))
         if load_target(p).engine.mooncake_global_segment_size is not None]
STORE_FIXTURES = [p for p in sorted(STORE_SCENARIOS.glob("*.yaml")) if p not in SIZED]


@pytest.fixture(scope="module")
def master():
    m = MasterProcess()
    yield m
    m.close()


def without_backend(result) -> dict:
    d = result.as_dict()
    d["store"].pop("backend")
    return d


@pytest.mark.parametrize("fixture", STORE_FIXTURES, ids=lambda p: p.stem)
def test_real_master_and_memory_store_agree_and_match_goldens(master, fixture):
    trace = load_target(fixture)
    on_memory = replay(trace, store=StoreSpec("memory"))
    held: set[str] = set()

    def snapshot(progress):        # while the worker's segment is still mounted
        held.update(master.all_keys())

    on_master = replay(trace, store=StoreSpec("mooncake", host=master.host, port=master.port),
                       progress=snapshot)
    assert on_master.store["backend"] == "mooncake"
    assert without_backend(on_memory) == without_backend(on_master)
    # Outcomes and keys also match the goldens recorded with the memory store.
    key, expect = select(trace.goldens, on_master.engine.key)
    assert compare(expect, on_master.requests) == []
    _, store_expect = select(trace.store_goldens, on_master.engine.key)
    assert compare_store(store_expect, observed(STORE, on_master)) == []
    # Every key written was really held by the master.
    assert set(on_master.as_dict()["store"]["puts"]) <= held
    # Gets moved bytes (a resend served from the store), and read them back intact:
    # RecordingStore raises on any difference, so reaching here proves it.
    gets = [r for r in on_master.store["rows"] if r["op"] == "get" and r["result"] > 0]
    if any(r.num_external_cached_tokens for r in on_master.requests):
        assert gets and all(r["bytes"] > 0 for r in gets)


def test_check_cli_starts_its_own_master():
    proc = cli("check", "--store", "mooncake", "fixtures/store/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS") == len(STORE_FIXTURES)
    assert SIZED and [line.split(":")[0] for line in proc.stdout.splitlines()
                      if line.startswith("SKIP")] == [f"SKIP fixtures/store/{p.name}"
                                                       for p in SIZED]
    assert proc.stderr == ""           # Mooncake's own logs stay quiet too


def test_a_trace_that_sizes_its_store_is_refused_on_a_real_master_in_one_line():
    proc = cli("check", "--store", "mooncake", SIZED[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"SKIP {SIZED[0]}: engine.mooncake_global_segment_size "
                                  "(32768 bytes): store pressure is replayed on the memory "
                                  "store"), proc.stdout
    assert "wall-clock leases" in proc.stdout and "--store-capacity" in proc.stdout
    assert len(proc.stdout.splitlines()) == 1


def test_unreachable_master_fails_fast_and_writes_nothing(tmp_path):
    from replayer.replay.store.master import free_port

    scenario = tmp_path / "s.yaml"
    shutil.copy(STORE_SCENARIOS / "shared_prefix_junction.yaml", scenario)
    before = scenario.read_text()
    t = time.monotonic()
    proc = cli("check", "--update-golden", "--store", f"mooncake://127.0.0.1:{free_port()}",
               str(scenario))
    elapsed = time.monotonic() - t
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replayer: error: store mooncake://127.0.0.1:")
    assert "master not reachable" in lines[0]
    assert elapsed < 10, f"took {elapsed:.1f}s"      # not the client's 90 s retry loop
    assert scenario.read_text() == before


def test_master_killed_mid_replay_stops_with_the_store_and_step(tmp_path, monkeypatch,
                                                                capsys):
    from replayer.cli import main as cli_mod
    from replayer.cli.progress import ProgressBar

    victim = MasterProcess()
    scenario = tmp_path / "s.yaml"
    shutil.copy(STORE_SCENARIOS / "resend_after_reset.yaml", scenario)
    before = scenario.read_text()

    def kill_at_step_3(self, p):
        if p.steps >= 3:
            victim.kill()

    monkeypatch.setattr(ProgressBar, "__call__", kill_at_step_3)
    # The master dies inside step 3's progress call, in this process: a replay on the
    # warm server would run on past step 3 while the progress frame travels.
    monkeypatch.setenv("PREFIX_REPLAYER_NO_SERVER", "1")
    try:
        code = cli_mod.main(["check", "--update-golden", "--store",
                             f"mooncake://{victim.address}", str(scenario)])
    finally:
        victim.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"replayer: error: store mooncake://{victim.address}: ")
    assert "RPC_FAIL (-900)" in err[-1]
    assert " at step 3" in err[-1]
    assert scenario.read_text() == before          # never a golden written


def test_a_full_real_pool_is_vllms_store_pressure_and_the_replay_goes_on(tmp_path):
    # Twelve distinct 50000-token prompts need ~30 MB of store; a 16 MB pool (the
    # smallest the client mounts) fills up and the master refuses further puts
    # (NO_AVAILABLE_HANDLE): vLLM's worker takes that as store pressure and skips
    # the request's later puts, so the replay goes on and says it once.
    header = (STORE_SCENARIOS / "shared_prefix_junction.yaml").read_text()
    engine = header[header.index("engine:"):header.index("requests:")]
    reqs = "".join(f"  - {{id: r{i}, prompt: [{{stream: s{i}, len: 50000}}]}}\n"
                   for i in range(12))
    scenario = tmp_path / "full.yaml"
    scenario.write_text(engine.replace("num_gpu_blocks: 256", "num_gpu_blocks: 2048")
                        + "requests:\n" + reqs)
    ops = tmp_path / "ops.parquet"
    proc = cli("run", "--store", "mooncake", "--store-capacity", "16MB", str(scenario),
               "--store-ops", ops)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "the pool was full" in line]
    assert len(notes) == 1, proc.stderr
    assert notes[0].startswith("replayer: note: store mooncake://127.0.0.1:")
    assert "NO_AVAILABLE_HANDLE, which vLLM's worker takes as store pressure" in notes[0]
    assert "this master never evicts" in notes[0]
    import polars as pl

    puts = pl.read_parquet(ops).filter(pl.col("op") == "put")
    refused = puts.filter(pl.col("result") == -200)
    assert refused.height > 0 and puts.filter(pl.col("result") == 0).height > 0
    assert f"the pool was full for {refused.height} put(s)" in notes[0]


def test_store_that_cannot_start_is_a_one_line_error():
    # The Mooncake client refuses to mount a pool this small.
    proc = cli("run", "--store", "mooncake", "--store-capacity", "64KB",
               "fixtures/store/shared_prefix_junction.yaml")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not start the Mooncake client" in lines[0]
    # The client log the line names is kept (the session's directory is removed
    # only when no error points into it).
    log = lines[0].split("client log: ")[1].rstrip(")")
    assert os.path.exists(log), log


# Run as root in a mount namespace of its own: the folder holding libibverbs.so.1
# is covered by one holding links to everything else in it, so the library is
# missing for this process and its children only (the machine keeps it).
HIDE_AND_START = """
import os, subprocess, sys, tempfile
lib = "libibverbs.so.1"
held = os.path.dirname(os.path.realpath(subprocess.run(
    ["sh", "-c", "ldconfig -p | sed -n 's/.*libibverbs.so.1 .*=> //p' | head -1"],
    capture_output=True, text=True, check=True).stdout.strip()))
orig, links = tempfile.mkdtemp(), tempfile.mkdtemp()
subprocess.run(["mount", "--bind", held, orig], check=True)
subprocess.run(["mount", "-t", "tmpfs", "none", links], check=True)
for name in os.listdir(orig):
    if not name.startswith("libibverbs.so"):
        os.symlink(os.path.join(orig, name), os.path.join(links, name))
subprocess.run(["mount", "--bind", links, held], check=True)
assert not os.path.exists(os.path.join(held, lib))
from replayer.replay.store import StoreError
from replayer.replay.store.master import MasterProcess
try:
    MasterProcess()
except StoreError as exc:
    print(exc)
"""


def test_a_master_missing_a_shared_library_says_which_and_keeps_its_log():
    """Where libibverbs.so.1 is not installed the master cannot start (exit 127):
    the error names the library and the Debian package, and the log it points to
    is there afterwards (it was deleted). Needs root (a mount namespace), as CI has."""
    import re
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(["unshare", "-m", sys.executable, "-c", HIDE_AND_START],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout.strip()
    m = re.fullmatch(r"mooncake_master exited with 127 at start: the shared library "
                     r"libibverbs\.so\.1 is not installed \(Debian/Ubuntu package libibverbs1: "
                     r"apt-get install libibverbs1\) \(log: (/\S+\.log)\)", said)
    assert m, said
    log = Path(m.group(1))
    try:
        assert "libibverbs.so.1: cannot open shared object file" in log.read_text()
    finally:
        log.unlink(missing_ok=True)


def test_json_is_identical_across_backends_but_for_the_backend(tmp_path):
    outs = {}
    for backend in ("memory", "mooncake"):
        out = tmp_path / f"{backend}.json"
        proc = cli("run", "--store", backend, "--json", str(out),
                   "fixtures/store/vllm51295_reset_before_turn2.yaml")
        assert proc.returncode == 0, proc.stderr
        outs[backend] = json.loads(out.read_text())
    assert outs["memory"]["store"].pop("backend") == "memory"
    assert outs["mooncake"]["store"].pop("backend") == "mooncake"
    assert outs["memory"] == outs["mooncake"]
    turn2 = outs["memory"]["requests"][1]
    assert turn2["num_external_cached_tokens"] == 24448
    lookups = outs["memory"]["store"]["lookups"]
    assert lookups[-1] == {"request": "turn2", "num_tokens": 50000, "hit_length": 24448}


@pytest.mark.model_worker
def test_the_model_worker_stores_on_a_real_master_as_on_the_memory_store(master, serve_venv):
    # vLLM's own worker and runner (.venv-serve) put the bytes its model wrote and
    # load them back into its KV tensors, through the real Mooncake client. With
    # EAGLE: the deferred save of a speculative step (replayer/replay/engines/worker/store.py).
    trace = load_target(FIXTURES / "traces" / "live_store_eagle")
    model = cold_client(resolve(parse_spec(str(serve_venv), "model")), own_process=True)
    held: set[str] = set()
    try:
        on_memory = model(trace, store=StoreSpec("memory"))
        on_master = model(trace, store=StoreSpec("mooncake", host=master.host,
                                                 port=master.port),
                          progress=lambda p: held.update(master.all_keys()))
    finally:
        model.close()
    assert on_master.store["backend"] == "mooncake" and on_master.engine.worker == "model"
    assert worker_differences(on_memory, on_master) == []
    assert set(on_master.as_dict()["store"]["puts"]) <= held
    gets = [r for r in on_master.store["rows"] if r["op"] == "get" and r["result"] > 0]
    assert gets and on_master.store["gets_checked"] == len(gets)
