"""Installing the recording hooks into a vLLM config the replayer built (0.32, 0.33).

Used when the CPU replay itself is recorded (round-trip tests, the overhead
benchmark, ``check --against recorded``): the same classes ``vllm serve``
loads by name, set on the config objects instead of the command line.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from replayer.recorder.session import CONFIG_KEY


def recording_into(out: str) -> Callable[[Any, str, bool], None]:
    """The ``recorder`` a replay is handed (:func:`replayer.replay.engines.open_engine`)
    to record itself into ``out``: a partial of a module-level function, so it
    crosses into an engine process or a warm fork as a pickle."""
    return partial(record_replay_into, str(out))


def record_replay_into(out: str, vllm_config: Any, version: str, connector: bool) -> None:
    """Check that vLLM ``version`` has every name the hooks use (RuntimeError in
    one line where it has not: the server makes the same check when it
    starts), then install them into ``vllm_config``."""
    from replayer.recorder.releases import check_release

    check_release(version, connector=connector)
    install_recorder(vllm_config, out)


def install_recorder(vllm_config: Any, out: str) -> None:
    from replayer.recorder.scheduler import record_into

    vllm_config.scheduler_config.scheduler_cls = record_into(vllm_config, str(out))
    ktc = vllm_config.kv_transfer_config
    if ktc is not None:
        ktc.kv_connector_module_path = "replayer.recorder.connector"
        ktc.kv_connector_extra_config = {**(ktc.kv_connector_extra_config or {}),
                                         CONFIG_KEY: str(out)}
