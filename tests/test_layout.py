"""The house's import rules (docs/layout.md), held by import-linter.

``[tool.importlinter]`` in pyproject.toml lists the contracts: ``traces``
never imports ``replayer``; the rooms of ``replayer`` and of
``replayer.replay`` import downward only; the warm server and its clients
share only leaves; no circle between sibling packages. A change that adds an
upward arrow or a circle fails here, naming the import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_every_import_contract_is_kept() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_upward_arrow_is_caught(tmp_path: Path) -> None:
    """The linter reads this repository and breaks on an arrow the house has
    (the CLI imports the replay): the contracts above are not vacuous."""
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["replayer"]\n'
        'exclude_type_checking_imports = true\n\n'
        '[[tool.importlinter.contracts]]\nname = "a deliberately wrong rule"\n'
        'type = "layers"\nlayers = ["replayer.replay", "replayer.cli"]\n')
    done = lint(str(config))
    assert done.returncode == 1, done.stdout[-2000:]
    assert "BROKEN" in done.stdout and "replayer.cli" in done.stdout
