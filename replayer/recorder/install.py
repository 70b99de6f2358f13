"""Installing the recording hooks into a vLLM config the replayer built (0.32, 0.33).

Used when the CPU replay itself is recorded (round-trip tests, the overhead
benchmark, ``check --against recorded``): the same classes ``vllm serve``
loads by name, set on the config objects instead of the command line.
"""

from __future__ import annotations

from typing import Any

from replayer.recorder.session import CONFIG_KEY


def install_recorder(vllm_config: Any, out: str) -> None:
    from replayer.recorder.scheduler import recording_scheduler_class

    sched = vllm_config.scheduler_config
    sched.scheduler_cls = recording_scheduler_class(str(out), bool(sched.async_scheduling))
    ktc = vllm_config.kv_transfer_config
    if ktc is not None:
        ktc.kv_connector_module_path = "replayer.recorder.connector"
        ktc.kv_connector_extra_config = {**(ktc.kv_connector_extra_config or {}),
                                         CONFIG_KEY: str(out)}
