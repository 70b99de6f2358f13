"""Pinning what would otherwise make two runs of the same trace differ.

Two things read ``PYTHONHASHSEED``: Python itself, for the iteration order of
sets of strings (vLLM frees finished requests from such sets, which decides
which cached blocks get evicted first), and vLLM's block hasher, for the seed of
every prefix-cache key. The first is fixed when the interpreter starts, so the
CLI re-executes itself once with a fixed seed; the second must be what the
recorded engine ran with, so it is set from the trace header while the engine
is built, whatever the user's shell says.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

INTERPRETER_SEED = "0"
_CHILD_FLAG = "_PREFIX_REPLAYER_PINNED"


def reexec_with_pinned_seed(argv: list[str]) -> None:
    """Re-run this command under a fixed interpreter hash seed (once)."""
    if os.environ.get(_CHILD_FLAG) == "1":
        return
    if os.environ.get("PYTHONHASHSEED") == INTERPRETER_SEED and _CHILD_FLAG in os.environ:
        return
    env = dict(os.environ)
    env[_CHILD_FLAG] = "1"
    env["PYTHONHASHSEED"] = INTERPRETER_SEED
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "replayer", *argv], env)


@contextmanager
def engine_hash_seed(seed: str | None) -> Iterator[None]:
    """Set PYTHONHASHSEED to the trace's ``engine.hash_seed`` (unset when None) meanwhile."""
    before = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = before
