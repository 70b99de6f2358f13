"""The pytest plugin (replayer/pytest/plugin.py), through real ``pytest`` runs in a
subprocess: what it collects (and where: ``replayer_paths`` or paths named on the
command line), the CLI's report on a broken golden, --replayer-update-golden,
markers, one engine process per xdist worker, and a foreign project's own options
and fixtures beside the installed plugin.

Each run replays on the installed vLLM in the plugin's engine process (~10 s of
vLLM imports per pytest process or worker).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from helpers_traces import REPO, cli

FIXTURES = REPO / "fixtures"
SCENARIOS = FIXTURES / "scenarios"
STORE = FIXTURES / "store"


def entry_point_installed() -> bool:
    return any(ep.name == "replayer" and ep.value == "replayer.pytest.plugin"
               for ep in metadata.entry_points(group="pytest11"))


def run_pytest(*args: object, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in a fresh interpreter. Where this environment was
    installed before the entry point existed, the plugin is named with ``-p``."""
    plugin = [] if entry_point_installed() else ["-p", "replayer.pytest.plugin"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "_PREFIX_REPLAYER"))}
    return subprocess.run([sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider",
                           *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def bundled_targets() -> list[str]:
    scenarios = sorted(p for p in FIXTURES.rglob("*.yaml"))
    traces = sorted(p for p in (FIXTURES / "traces").iterdir() if (p / "header.json").exists())
    return [str(p.relative_to(REPO)) for p in [*scenarios, *traces]]


def bundled_items(*engines: str) -> list[str]:
    """The items ``pytest fixtures/`` collects on ``engines``: one per target and
    engine, and an ``ENGINE:recompute`` item beside it for a scenario that
    expects every hit to match its recompute (``expect_recompute: true``)."""
    items = []
    for target in bundled_targets():
        path = REPO / target
        recompute = path.is_file() and re.search(r"^expect_recompute:\s*true\b",
                                                  path.read_text(), re.M)
        for engine in engines:
            items.append(f"{target}::{engine}")
            if recompute:
                items.append(f"{target}::{engine}:recompute")
    return items


def test_the_entry_point_loads_the_plugin(tmp_path):
    """pyproject's pytest11 entry point, as pip installs it (a dist-info with
    entry_points.txt on the path), makes plain ``pytest fixtures/`` collect."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    points = data["project"]["entry-points"]["pytest11"]
    assert points == {"replayer": "replayer.pytest.plugin"}
    assert "pytest-xdist" in " ".join(data["project"]["optional-dependencies"]["test"])
    if os.environ.get("CI") == "true":              # CI installs the package from this tree
        assert entry_point_installed()
    dist = tmp_path / "site" / "replayer_entry_point-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: replayer-entry-point\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(dist.parent),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--collect-only", "-q", "fixtures/scenarios/"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(list(SCENARIOS.glob('*.yaml')))} tests collected" in proc.stdout


def test_collects_every_fixture_once_per_engine():
    proc = run_pytest("--collect-only", "-q", "fixtures/", "--replayer-engine", "installed",
                      "--replayer-engine", "vllm==0.29.0", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert sorted(ids) == sorted(bundled_items("installed", "vllm==0.29.0"))
    assert len(bundled_targets()) >= 11             # the JSONL slice and READMEs are not targets


def test_markers_come_from_the_target():
    proc = run_pytest("--collect-only", "-q", "fixtures/", "-m", "slow", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # conversation_500 (500 requests) and live_llama (250): the traces of 200 or more.
    assert sorted(line for line in proc.stdout.splitlines() if "::" in line) == [
        "fixtures/traces/conversation_500::installed", "fixtures/traces/live_llama::installed"]
    proc = run_pytest("--collect-only", "-q", "fixtures/", "-m", "real_master",
                      "--replayer-store", "mooncake", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    selected = sorted(line for line in proc.stdout.splitlines() if "::" in line)
    # Every target with a store connector: the store scenarios, Kimi-K3's store
    # fixtures and the live store recordings.
    kimi = [p for p in (FIXTURES / "kimi_k3").glob("*.yaml") if "connector:" in p.read_text()]
    assert kimi
    stores = {f"fixtures/store/{p.name}" for p in STORE.glob("*.yaml")} | {
        f"fixtures/kimi_k3/{p.name}" for p in kimi} | {
        f"fixtures/traces/{p.name}" for p in (REPO / "fixtures" / "traces").glob("live_store_*")}
    assert selected == sorted(i for i in bundled_items("installed") if i.split("::")[0] in stores)
    # On the memory store nothing needs a master.
    proc = run_pytest("--collect-only", "-q", "fixtures/", "-m", "real_master", cwd=REPO)
    assert proc.returncode == 5, proc.stdout          # pytest: no tests collected


def test_other_yaml_is_left_alone(tmp_path):
    (tmp_path / "ci.yaml").write_text("jobs:\n  test: {runs-on: ubuntu}\n")
    (tmp_path / "engine.yaml").write_text("engine: {block_size: 16}\n")
    proc = run_pytest("--collect-only", "-q", ".", cwd=tmp_path)
    assert proc.returncode == 5, proc.stdout + proc.stderr


@pytest.fixture()
def broken(tmp_path: Path) -> Path:
    """A hybrid scenario expecting 4480 (gets 3072), a store scenario expecting a
    Mamba put at 8192 (gets 8320), and a fixture that passes."""
    text = (SCENARIOS / "shared_system_prompt_hybrid.yaml").read_text()
    assert "user_c: {num_cached_tokens: 3072}" in text
    (tmp_path / "junction.yaml").write_text(
        text.replace("user_c: {num_cached_tokens: 3072}", "user_c: {num_cached_tokens: 4480}"))
    text = (STORE / "shared_prefix_junction.yaml").read_text()
    assert "user_b: {0: [6144, 7680, 8448], 1: [6144, 8320]}" in text
    (tmp_path / "store_keys.yaml").write_text(text.replace("1: [6144, 8320]}", "1: [6144, 8192]}"))
    shutil.copy(SCENARIOS / "reset_prefix_cache.yaml", tmp_path / "passes.yaml")
    return tmp_path


def test_a_broken_golden_fails_with_the_cli_report(broken):
    proc = run_pytest("-q", ".", cwd=broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 failed, 1 passed" in proc.stdout
    for name in ("junction.yaml", "store_keys.yaml"):
        check = cli("check", name, cwd=broken)
        assert check.returncode == 1 and check.stdout.startswith(f"FAIL {name}:"), check.stdout
        for line in check.stdout.splitlines():      # every line of the CLI's report
            assert line in proc.stdout.splitlines(), (line, proc.stdout)
    report = proc.stdout
    assert ("  first divergence: request user_c (arrived at step 15, prefill at step 17): "
            "num_cached_tokens expected 4480, got 3072") in report
    assert "  why user_c: group 0 (full_attention, EAGLE drop applied) alone could hit 4480" in report
    assert "    missing put: group 1 @ 8192 (user_b)" in report
    assert "    extra put: group 1 @ 8320 (user_b)" in report
    assert "Traceback" not in report and "Captured stderr" not in report


def test_update_golden_rewrites_and_still_fails(broken):
    before = (broken / "junction.yaml").read_text()
    proc = run_pytest("-q", "junction.yaml", "store_keys.yaml", "--replayer-update-golden",
                      cwd=broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 failed" in proc.stdout
    assert f"UPDATED {broken / 'junction.yaml'}: goldens for any engine rewritten" in proc.stdout
    assert "store goldens rewritten" in proc.stdout
    after = (broken / "junction.yaml").read_text()
    assert "user_c: {num_cached_tokens: 3072}" in after
    assert after.split("expect:")[0] == before.split("expect:")[0]      # only goldens changed
    assert "1: [6144, 8320]}" in (broken / "store_keys.yaml").read_text()
    proc = run_pytest("-q", ".", cwd=broken)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout


def test_no_goldens_and_bad_input_fail_in_one_line(tmp_path):
    # Goldens only for 0.29.0: the installed 0.33.0 has none; the item fails without a
    # replay (this engine could not even hold the request: a replay would say so).
    (tmp_path / "only029.yaml").write_text(
        "engine: {block_size: 16, num_gpu_blocks: 8}\n"
        "requests:\n  - {id: big, prompt: [{stream: doc, len: 3000}]}\n"
        'expect:\n  "vllm==0.29.0": {big: {num_cached_tokens: 0}}\n')
    (tmp_path / "typo.yaml").write_text("requests:\n  - {id: a, promt: []}\n")
    proc = run_pytest("-q", ".", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert ("FAIL only029.yaml: no goldens for engine vllm==0.33.0 (record them with "
            "--replayer-update-golden); not replayed") in out
    bad = [line for line in out if line.startswith("replayer: error: ")]
    assert len(bad) == 1 and "typo.yaml" in bad[0] and "promt" in bad[0], proc.stdout


def test_xdist_two_workers_one_engine_process_each(tmp_path):
    for name in ("reset_prefix_cache", "sliding_window", "pmu_below_block_no_drop",
                 "vllm51295_turn1_24577"):
        shutil.copy(SCENARIOS / f"{name}.yaml", tmp_path / f"{name}.yaml")
    # Each pytest process (each worker) writes how many engine processes it started.
    (tmp_path / "conftest.py").write_text(
        "import os\n"
        "from replayer.pytest.plugin import _POOL\n"
        "def pytest_sessionfinish(session):\n"
        "    worker = os.environ.get('PYTEST_XDIST_WORKER', 'main')\n"
        "    pool = session.config.stash[_POOL]\n"
        "    with open(f'started-{worker}.txt', 'w') as fh:\n"
        "        fh.write(str(pool.started))\n")
    proc = run_pytest("-q", "-n", "2", ".", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 passed" in proc.stdout
    started = {p.name: int(p.read_text()) for p in tmp_path.glob("started-*.txt")}
    assert started == {"started-gw0.txt": 1, "started-gw1.txt": 1, "started-main.txt": 0}


# -- a foreign project beside the installed plugin -----------------------------------------

FOREIGN_CONFTEST = """
import pytest

def pytest_addoption(parser):
    parser.addoption("--store", default="sqlite")
    parser.addoption("--update-golden", action="store_true")

@pytest.fixture
def replayer():
    return "the project's own replayer"
"""

FOREIGN_TEST = """
def test_own_options_and_fixture(replayer, pytestconfig):
    assert replayer == "the project's own replayer"
    assert pytestconfig.getoption("--store") == "postgres"
    assert pytestconfig.getoption("--update-golden") is True
    assert pytestconfig.getoption("--replayer-engine") == ["installed"]     # the plugin's
"""


@pytest.fixture()
def foreign(tmp_path: Path) -> Path:
    """Another project: a conftest claiming ``--store``, ``--update-golden`` and a
    fixture ``replayer``, one test, and under data/ a YAML with a top-level
    ``requests:`` key and a directory with a header.json (not replayer targets)."""
    (tmp_path / "conftest.py").write_text(FOREIGN_CONFTEST)
    (tmp_path / "test_foreign.py").write_text(FOREIGN_TEST)
    data = tmp_path / "data"
    (data / "recording").mkdir(parents=True)
    (data / "recording" / "header.json").write_text('{"format": "not a replayer trace"}\n')
    (data / "http_mocks.yaml").write_text("requests:\n  - {method: GET, url: /health}\n")
    return tmp_path


def collected(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line for line in proc.stdout.splitlines() if "::" in line)


def test_a_foreign_projects_own_options_and_fixture_run_beside_the_plugin(foreign):
    proc = run_pytest("-q", "--store", "postgres", "--update-golden",
                      "--replayer-engine", "installed", cwd=foreign)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "error" not in proc.stderr.lower(), proc.stderr


def test_targets_outside_replayer_paths_and_the_command_line_are_not_collected(foreign):
    own = ["test_foreign.py::test_own_options_and_fixture"]
    # No path given (pytest takes the current directory), testpaths covering data/,
    # or only the test file named: data/ is not the plugin's to collect.
    for args in ([], ["-o", "testpaths=data test_foreign.py"], ["test_foreign.py"]):
        proc = run_pytest("--collect-only", "-q", *args, cwd=foreign)
        assert proc.returncode == 0, (args, proc.stdout + proc.stderr)
        assert collected(proc) == own, (args, proc.stdout)
    # Opting in: the ini option, or naming the folder (or a target) on the command line.
    targets = ["data/http_mocks.yaml::installed", "data/recording::installed"]
    proc = run_pytest("--collect-only", "-q", "-o", "replayer_paths=data", cwd=foreign)
    assert collected(proc) == sorted([*own, *targets]), proc.stdout + proc.stderr
    proc = run_pytest("--collect-only", "-q", "data", cwd=foreign)
    assert collected(proc) == targets, proc.stdout + proc.stderr
    proc = run_pytest("--collect-only", "-q", "data/recording", cwd=foreign)
    assert collected(proc) == ["data/recording::installed"], proc.stdout + proc.stderr


def test_this_repositorys_replayer_paths_collect_without_naming_them():
    """pyproject.toml's replayer_paths: a run whose testpaths cover fixtures/ collects
    every bundled target though no path is named."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert data["tool"]["pytest"]["ini_options"]["replayer_paths"] == ["fixtures", "examples"]
    proc = run_pytest("--collect-only", "-q", "-o", "testpaths=fixtures", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert collected(proc) == sorted(bundled_items("installed"))


@pytest.mark.parametrize("bare", [["--update-golden"], ["--store=mooncake"],
                                  ["--store-capacity=64MB"]])
def test_the_bare_option_names_are_not_the_plugins(tmp_path, bare):
    shutil.copy(SCENARIOS / "reset_prefix_cache.yaml", tmp_path / "s.yaml")
    proc = run_pytest("-q", *bare, "s.yaml", cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr      # pytest's usage error
    assert f"error: unrecognized arguments: {bare[0]}" in proc.stderr, proc.stderr
