"""Choosing the adapter for the vLLM that will run the replay.

Each adapter module serves one release range and holds every difference of
that range; nothing outside ``replayer.engines`` names a vLLM class.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

from .base import EngineAdapter, EngineInfo, EngineRequest, PrefillOutcome, StepResult

# release prefix -> adapter module
ADAPTERS: dict[str, str] = {
    "0.33": "replayer.engines.vllm_0_33",
}


class EngineError(RuntimeError):
    """The engine cannot be built for this trace (bad geometry, unsupported release)."""


def installed_vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise EngineError("vLLM is not installed in this environment "
                          "(pip install vllm==0.33.0)") from None


def adapter_module_for(version: str) -> str:
    for prefix, module in ADAPTERS.items():
        if version == prefix or version.startswith(prefix + "."):
            return module
    raise EngineError(f"no adapter for vLLM {version} (supported release ranges: "
                      f"{', '.join(p + '.x' for p in ADAPTERS)})")


def open_engine(engine: dict[str, Any], max_model_len: int, spec: str = "installed",
                store: Any = None) -> EngineAdapter:
    """Build the engine named by ``spec`` (only ``installed`` for now).

    ``store`` is a :class:`replayer.store.StoreSpec` for traces with a connector."""
    if spec != "installed":
        raise EngineError(f"engine {spec!r}: only 'installed' is supported in this release")
    version = installed_vllm_version()
    module = importlib.import_module(adapter_module_for(version))
    try:
        if engine.get("connector"):
            return module.open_engine(engine, max_model_len, version, store=store)
        return module.open_engine(engine, max_model_len, version)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        # vLLM validates geometry with ValueError/AssertionError: say it in one line.
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineError(f"vLLM {version} cannot build this engine: {msg}") from exc


__all__ = ["ADAPTERS", "EngineAdapter", "EngineError", "EngineInfo", "EngineRequest",
           "PrefillOutcome", "StepResult", "installed_vllm_version", "open_engine"]
