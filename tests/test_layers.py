"""The arrows of docs/layout.md point down: the replay never reaches up into the
recorder. A recording replay gets its recorder from the caller
(``open_engine(recorder=...)``, :func:`replayer.recorder.install.recording_into`)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def _reaches(path: Path, package: str) -> list[str]:
    """Where ``path`` imports ``package`` or names it in a string (importlib)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith(package + ".") else []
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                  if n == package or n.startswith(package + ".")]
    return found


def test_the_replay_imports_nothing_of_the_recorder():
    files = sorted((REPO / "replayer" / "replay").rglob("*.py"))
    assert len(files) > 30
    found = [hit for f in files for hit in _reaches(f, "replayer.recorder")]
    assert found == [], "\n".join(found)
