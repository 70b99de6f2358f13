"""Choosing the adapter for the vLLM that will run the replay.

Each adapter module serves one release range and holds every difference of
that range; nothing outside ``replayer.replay.engines`` names a vLLM class. Which
vLLM runs is an engine spec (:mod:`.specs`): the installed one runs in this
process; a release or a source tree runs in a child process whose
``sys.path`` puts its sources first (:mod:`replayer.replay.execution.child_process`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from importlib import metadata
from typing import TYPE_CHECKING, Any, Iterable

from replayer.replay.engines.base import (
    EngineAdapter,
    EngineError,
    EngineInfo,
    EngineRequest,
    PrefillOutcome,
    StepResult,
    UnsupportedByEngine,
)
from traces.model.engine_spec import EngineBlock

if TYPE_CHECKING:
    from replayer.replay.engines.sources.specs import ResolvedEngine

# release prefix -> adapter module (consecutive prefixes of one module form a range)
ADAPTERS: dict[str, str] = {
    "0.26": "replayer.replay.engines.vllm_0_29",
    "0.27": "replayer.replay.engines.vllm_0_29",
    "0.28": "replayer.replay.engines.vllm_0_29",
    "0.29": "replayer.replay.engines.vllm_0_29",
    "0.30": "replayer.replay.engines.vllm_0_29",
    "0.31": "replayer.replay.engines.vllm_0_29",
    "0.32": "replayer.replay.engines.vllm_0_29",
    "0.33": "replayer.replay.engines.vllm_0_33",
    "0.34": "replayer.replay.engines.vllm_0_33",
}


# release prefix -> store adapter module, for releases whose MooncakeStore API
# the replay drives. One module serves 0.29-0.34: what its seams touch (the
# scheduler's LookupKeyClient, the lookup server's call into the worker, the
# wire encoding, the worker's queues, the key format) is the same in all six
# but two things of 0.34's, handled there: its lookup client's methods
# (prefetch, a wall-clock result cache: the in-process client answers each,
# lookup_async is refused) and its model runner's connector step
# (ActiveKVConnector, connector_step); what changed between them (where the
# worker puts boundary keys, #56615) is vLLM code the replay runs as it is. A
# release range whose seams differ gets its own module here.
STORE_ADAPTERS: dict[str, str] = {
    "0.29": "replayer.replay.engines.connector.mooncake_0_33",
    "0.30": "replayer.replay.engines.connector.mooncake_0_33",
    "0.31": "replayer.replay.engines.connector.mooncake_0_33",
    "0.32": "replayer.replay.engines.connector.mooncake_0_33",
    "0.33": "replayer.replay.engines.connector.mooncake_0_33",
    "0.34": "replayer.replay.engines.connector.mooncake_0_33",
}


def release_prefix(version: str, prefixes: Iterable[str]) -> str | None:
    """The first of ``prefixes`` (``0.33``, ``0.33.1``) that release ``version``
    falls under (``0.33`` covers ``0.33.0`` but not ``0.330``), or None."""
    return next((p for p in prefixes if version == p or version.startswith(p + ".")), None)


# Releases whose OffloadingConnector the replay drives (connector: offloading):
# 0.32, 0.33 and 0.34 (below). What connector/offloading_0_33.py touches is the same in 0.32 and 0.33
# (the connector and its worker/scheduler attributes, the manager's lookup,
# prepare_load, prepare_store and complete_store, the offload key helpers,
# LookupResult, TransferResult); 0.32 lacks 0.33's sliding-window chunks and
# synchronous loads (sync_load_budget_bytes), which vLLM itself then refuses or
# ignores. 0.29's differs in every module the replay touches (the connector,
# its scheduler, worker and config, the CPU spec and manager) and has no hybrid
# groups (get_offloading_group_ids is 0.33's); not covered yet. 0.34 too: its
# worker resolves each transfer's device pointers from the KV caches it
# registered, so there the replay registers small CPU tensors
# (REGISTERS_KV_CACHES in connector/offloading_0_33.py).
OFFLOADING_RELEASES: tuple[str, ...] = ("0.32", "0.33", "0.34")


def check_connector(version: str, connector: str | None, label: str) -> None:
    """Refuse a connector trace on a release no store adapter serves (no vLLM import)."""
    if connector == "offloading" and release_prefix(version, OFFLOADING_RELEASES) is None:
        raise UnsupportedByEngine(
            f"{label}: connector replay (offloading) is not supported on vLLM {version} yet "
            f"(its OffloadingConnector differs from 0.32-0.34's; replayed on "
            f"{', '.join(p + '.x' for p in OFFLOADING_RELEASES)})")
    if connector and release_prefix(version, STORE_ADAPTERS) is None:
        served = ", ".join(f"{p}.x" for p in STORE_ADAPTERS)
        raise UnsupportedByEngine(f"{label}: connector replay ({connector}) is not supported "
                                  f"on vLLM {version} yet (its MooncakeStore API differs; "
                                  f"replayed on {served})")


# Releases whose MooncakeStore scheduler cannot save decode blocks (vLLM itself
# fails an assertion there, so no replay of it could be right).
DECODE_SAVE_ASSERTS: tuple[str, ...] = ("0.29",)

# release prefix -> the Mamba cache modes its CacheConfig takes beyond align and
# none: "all" (every block's state cached) is 0.26-0.31's; 0.32 removed it.
MAMBA_CACHE_MODE_ALL: tuple[str, ...] = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31")


# speculative method -> the first release that builds it on a machine without a
# GPU: before 0.33, vLLM chooses its V1 model runner where Triton has no driver, and
# that runner raises "Model Runner V1 does not support: dspark speculative decoding"
# (docs/limits.md). With a GPU the release itself is left to answer.
SPECULATIVE_METHOD_SINCE: dict[str, tuple[int, int]] = {"dspark": (0, 33)}


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_supported(version: str, engine: EngineBlock, label: str,
                    worker: str = "null") -> None:
    """Refuse, before vLLM is imported, a trace needing what release ``version``
    lacks (a connector no store adapter serves, a Mamba cache mode it removed),
    and, for the model worker, a geometry no tiny model here takes."""
    check_connector(version, engine.connector, label)
    if worker == "model":
        from replayer.replay.engines.worker.models import check_geometry

        check_geometry(engine, label)
    if engine.has_mamba and engine.mamba_cache_mode == "all" and release_prefix(
            version, MAMBA_CACHE_MODE_ALL) is None:
        served = ", ".join(f"{p}.x" for p in MAMBA_CACHE_MODE_ALL)
        raise UnsupportedByEngine(f"{label}: engine.mamba_cache_mode 'all' is not in vLLM "
                                  f"{version} (its CacheConfig takes align or none; 'all' "
                                  f"replays on {served})")
    if (engine.connector_config or {}).get("save_decode_cache") and release_prefix(
            version, DECODE_SAVE_ASSERTS):
        raise UnsupportedByEngine(
            f"{label}: connector_config.save_decode_cache on vLLM {version}: its MooncakeStore "
            "scheduler asserts on the first decode-phase save ('Missing current block table "
            "for store request', _apply_current_save_block_ids: the step's block_state holds "
            "only requests given new blocks); 0.30 and later run it")
    method = engine.speculative.method if engine.speculative is not None else None
    since = SPECULATIVE_METHOD_SINCE.get(method or "")
    release = _release(version)
    if since is not None and release is not None and release < since and not _has_gpu():
        raise UnsupportedByEngine(f"{label}: speculative method {method} needs vLLM "
                                  f"{since[0]}.{since[1]} or later on a machine without a "
                                  "GPU (this release's V1 model runner does not build it)")


def store_adapter(version: str, connector: str, label: str) -> Any:
    """The store adapter module serving ``version`` (refused as check_connector says)."""
    check_connector(version, connector, label)
    return importlib.import_module(STORE_ADAPTERS[release_prefix(version, STORE_ADAPTERS)])


def installed_vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise EngineError("vLLM is not installed in this environment: the replay engine "
                          "is an extra, pip install 'prefix-replayer[replay]'") from None


def supported_ranges() -> str:
    """``0.26.x-0.32.x, 0.33.x-0.34.x``: the release ranges, one per adapter module."""
    runs: list[list[str]] = []
    last = None
    for prefix, module in ADAPTERS.items():
        if module == last:
            runs[-1].append(prefix)
        else:
            runs.append([prefix])
        last = module
    return ", ".join(f"{r[0]}.x" if len(r) == 1 else f"{r[0]}.x-{r[-1]}.x" for r in runs)


def adapter_module_for(version: str) -> str:
    prefix = release_prefix(version, ADAPTERS)
    if prefix is not None:
        return ADAPTERS[prefix]
    raise EngineError(f"no adapter for vLLM {version} (supported release ranges: "
                      f"{supported_ranges()})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _refusing(recorder: Any) -> Any:
    """``recorder`` whose RuntimeError (a release it cannot hook) is an
    :class:`UnsupportedByEngine`, which ``check`` reports as SKIP."""
    def install(config: Any, version: str, connector: bool) -> None:
        try:
            recorder(config, version, connector)
        except RuntimeError as exc:
            raise UnsupportedByEngine(f"recording a replay on vLLM {version}: {exc}") from None
    return install


def open_engine(engine: EngineBlock, spec: "ResolvedEngine", store: Any = None,
                recorder: Any = None, kv_events: bool = False) -> EngineAdapter:
    """Build the adapter for ``spec`` over a sized engine block, in this process.

    Called only by :mod:`replayer.replay.execution.in_process`, which decides where an engine runs:
    ``spec`` is the installed vLLM or the sources this process imports (a
    child started by :mod:`replayer.replay.execution.child_process`). ``store`` is a
    :class:`replayer.replay.store.StoreSpec` for traces with a connector; ``recorder``,
    the caller's (the replay knows no recorder), is called as ``recorder(vllm_config,
    version, connector)`` before the engine is built, to put its hooks into the
    config, and raises RuntimeError for a release it cannot record (said as
    :class:`UnsupportedByEngine`); ``kv_events`` turns vLLM's
    KV-cache events on and collects them (adapters with ``supports_kv_events``)."""
    if not spec.runs_here():
        raise EngineError(f"engine {spec.info.label} runs in a process of its own: replay it "
                          "through replayer.replay.execution.clients.engine_runner or the command line")
    info = spec.info
    version = info.vllm
    check_supported(version, engine, info.label, spec.worker)
    try:
        module = importlib.import_module(adapter_module_for(version))
    except EngineError:
        raise
    except Exception as exc:  # noqa: BLE001 - a patched tree that does not import is bad input
        raise EngineError(f"{info.label}: importing vLLM failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from exc
    try:
        extra = {} if spec.worker == "null" else {"worker": spec.worker}
        if engine.prefill_instance is not None:     # a P/D pair: connector/pd_pair.py
            from replayer.replay.engines.connector.pd_pair import open_pair

            if recorder is not None:
                raise UnsupportedByEngine(f"{info.label}: recording a replay of a "
                                          "prefill/decode pair (engine.prefill_instance) is "
                                          "not supported: a recording holds one engine")
            adapter = open_pair(module.open_engine, engine, version, store, kv_events, **extra)
        else:
            adapter = module.open_engine(engine, version, store=store, recorder=None
                                         if recorder is None else _refusing(recorder),
                                         kv_events=kv_events, **extra)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        # vLLM validates geometry with ValueError/AssertionError (pydantic's too):
        # one line naming the engine field (replayer.replay.engines.config.errors).
        from replayer.replay.engines.config.errors import describe

        raise EngineError(describe(exc, version)) from exc
    if kv_events and not adapter.supports_kv_events:
        adapter.close()
        raise UnsupportedByEngine(f"{info.label}: KV-cache events are not collected on "
                                  f"vLLM {version} (its adapter lacks them)")
    adapter.info = replace(info, dropped=tuple(adapter.dropped)) if adapter.dropped else info
    # Defaults the replayer chose where vLLM's would be refused are said first.
    adapter.notes = [*engine.chosen, *adapter.notes]
    return adapter


__all__ = ["ADAPTERS", "STORE_ADAPTERS", "check_connector", "check_supported", "store_adapter",
           "EngineAdapter", "EngineError", "EngineInfo", "EngineRequest",
           "PrefillOutcome", "StepResult", "UnsupportedByEngine", "installed_vllm_version",
           "open_engine", "supported_ranges"]
