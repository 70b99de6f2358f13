"""What every test module shares: the repository's paths, the CLI in a fresh
interpreter, and a quiet vLLM. Helper modules (``helpers_traces``,
``helpers_engines``) build on these."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
SCENARIOS = FIXTURES / "scenarios"
STORE_SCENARIOS = FIXTURES / "store"
TRACES = FIXTURES / "traces"
# The first 500 lines of the public Mooncake conversation trace, kept in the repo
# so that a clone alone runs the tests (fixtures/mooncake/README.md says whence).
MOONCAKE_TRACE = FIXTURES / "mooncake" / "conversation_trace_head500.jsonl"

# Environment a replay in this process reads before vLLM is imported: quiet logs, no hub.
QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_LOGS": "-torch", "HF_HUB_OFFLINE": "1",
         "MC_LOG_LEVEL": "ERROR"}


def cli(*args: object, env: dict[str, str] | None = None, cwd: Path = REPO,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m replayer ARGS`` in a fresh interpreter (it pins its own hash seed)."""
    full = {k: v for k, v in os.environ.items() if k != "_PREFIX_REPLAYER_PINNED"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "replayer", *map(str, args)], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def quiet_vllm():
    """vLLM, torch and Mooncake stay quiet in this process unless the shell says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in QUIET.items():
            if name not in os.environ:
                mp.setenv(name, value)
        yield
