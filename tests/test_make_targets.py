"""What `make demo` and `make test` would run on a fresh machine (`make -n`).

A newcomer's first command must need neither root nor a browser nor Ray: the
demo installs the replay engine only; the test target adds the system
packages and every extra the suite uses.
"""

from __future__ import annotations

import os
import subprocess

from conftest import REPO


def dry_run(target: str, tmp_path) -> list[str]:
    # Under `make test` this runs inside make: its MAKEFLAGS/MAKELEVEL would make
    # the inner make print "Entering/Leaving directory" lines.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target,
                           f"VENV={tmp_path}/venv", f"SERVE_VENV={tmp_path}/serve"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_demo_installs_the_replay_engine_only(tmp_path):
    lines = dry_run("demo", tmp_path)
    installs = [line for line in lines if " install " in line and "-e " in line]
    assert installs == [f"{tmp_path}/venv/bin/pip install --quiet -e '.[replay]'"]
    assert not any("system-deps" in line or "apt-get" in line or "sudo" in line
                   for line in lines), lines
    assert lines[-1] == (f"{tmp_path}/venv/bin/replayer check "
                         "fixtures/scenarios/vllm51295_turn1_24577.yaml")


def test_make_test_installs_everything_the_suite_uses(tmp_path):
    lines = dry_run("test", tmp_path)
    assert "scripts/system-deps.sh" in lines
    assert f"{tmp_path}/venv/bin/pip install --quiet -e '.[replay,test,mooncake,ray]'" in lines
    assert any(line.endswith(f"scripts/install-serve-venv.sh {tmp_path}/serve") for line in lines)
    assert lines[-1].endswith("scripts/run-tests.sh")


def test_make_demo_cpu_builds_the_cpu_torch_venv_and_checks_the_fixture(tmp_path):
    """The slim route (docs/benchmarks.md: ~3 GB, not ~10): its own venv, built by the
    script that puts a CPU torch in first and leaves the CUDA-only packages out."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "demo-cpu",
                           f"CPU_VENV={tmp_path}/cpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [f"PYTHON=python3 scripts/install-cpu-venv.sh {tmp_path}/cpu",
                     f"{tmp_path}/cpu/bin/replayer check "
                     "fixtures/scenarios/vllm51295_turn1_24577.yaml"], lines
    script = (REPO / "scripts" / "install-cpu-venv.sh").read_text()
    assert '"$PIP" install --quiet -e .\n' in script          # not [replay]: no CUDA torch
    assert 'endswith("+cpu")' in script


def test_make_serve_venv_installs_its_system_packages_first(tmp_path):
    """`make serve-venv` stands alone on a fresh machine: the system packages the
    serving venv loads (libibverbs1 for the Mooncake client, libnuma1) come before
    its install, not only through `make test`."""
    lines = dry_run("serve-venv", tmp_path)
    assert lines[0] == "scripts/system-deps.sh serve", lines
    assert lines[1].endswith(f"scripts/install-serve-venv.sh {tmp_path}/serve"), lines
    script = (REPO / "scripts" / "system-deps.sh").read_text()
    serve_part = script.split('if [ "$what" = all ]', 1)[0]
    assert "libibverbs1" in serve_part and "libnuma1" in serve_part
