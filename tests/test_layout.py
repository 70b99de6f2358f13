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


# Rooms held to functions a screen long: a function over SCREEN lines says why on
# the line above its ``def`` (``# long: REASON``); none is over LIMIT at all.
SCREEN, LIMIT = 60, 80
# Every room of the package (the replay and the checks first; analysis/ and recorder/
# joined once explain, the report figures, engine_block and shrink's rounds were split).
SHORT_ROOMS = ("replayer",)


def long_functions(root: Path, base: Path = REPO) -> list[tuple[int, str, bool]]:
    """(lines, ``path:name`` with the path from ``base``, whether a reason is
    written) of every function over :data:`SCREEN` lines under ``root``."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                said = first >= 2 and lines[first - 2].strip().startswith("# long:")
                if size > SCREEN:
                    found.append((size, f"{path.relative_to(base)}:{node.name}", said))
    return found


def test_functions_are_a_screen_long_in_every_room() -> None:
    found = [f for room in SHORT_ROOMS for f in long_functions(REPO / room)]
    too_long = [f"{name} ({size} lines)" for size, name, _ in found if size > LIMIT]
    unexplained = [f"{name} ({size} lines)" for size, name, said in found
                   if size <= LIMIT and not said]
    assert not too_long, f"over {LIMIT} lines: {too_long}"
    assert not unexplained, f"over {SCREEN} lines with no '# long:' reason: {unexplained}"


def test_the_length_rule_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(SCREEN + 5))
    (tmp_path / "m.py").write_text(f"def quiet():\n{body}\n\n\n# long: a table\ndef said():\n{body}\n")
    found = sorted(long_functions(tmp_path, base=tmp_path))
    assert [(name, said) for _, name, said in found] == [("m.py:quiet", False), ("m.py:said", True)]
