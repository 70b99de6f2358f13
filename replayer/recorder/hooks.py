"""Every vLLM name the recorder's hooks use, in one list, and the check of them.

The recorder subclasses vLLM's scheduler and connector and reads vLLM's
objects; a release that renamed or dropped one of those names would record
wrong or crash mid-run. So when the server starts, before recording anything,
:func:`missing_hooks` looks each name up in the vLLM that is running (any
release, nightly or fork) and the recorder refuses in one line naming the first
one missing. A version no test has recorded on but whose names are all there
records, with a one-line warning (:mod:`.releases`).

A hook is ``module:Class.attr``. ``attr`` is found when the class (or a base)
has it, declares it as a field (dataclass, pydantic, msgspec), or assigns
``self.attr`` in its source: the recorder reads instance attributes too
(``request.block_hashes``), which exist on objects, not classes. A hook with
``(params)`` also needs those parameter names (the recorder passes them by
position and keyword as vLLM's own callers do).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

SCHED = "vllm.v1.core.sched.scheduler"

# What the scheduler hooks (.scheduler) and the header (.header) use.
SCHEDULER_HOOKS: tuple[str, ...] = (
    f"{SCHED}:Scheduler.add_request(request)",
    f"{SCHED}:Scheduler.schedule",
    f"{SCHED}:Scheduler.update_from_output(scheduler_output, model_runner_output)",
    f"{SCHED}:Scheduler.finish_requests(request_ids, finished_status)",
    f"{SCHED}:Scheduler._free_request(request)",
    f"{SCHED}:Scheduler.reset_prefix_cache(reset_running_requests, reset_connector)",
    f"{SCHED}:Scheduler.shutdown",
    f"{SCHED}:Scheduler.vllm_config",
    f"{SCHED}:Scheduler.kv_cache_config",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.request:RequestStatus.FINISHED_ABORTED",
    "vllm.v1.request:Request.request_id",
    "vllm.v1.request:Request.prompt_token_ids",
    "vllm.v1.request:Request.max_tokens",
    "vllm.v1.request:Request.output_token_ids",
    "vllm.v1.request:Request.block_hashes",
    "vllm.v1.request:Request.lora_request",
    "vllm.v1.request:Request.cache_salt",
    "vllm.v1.request:Request.priority",
    "vllm.v1.request:Request.status",
    "vllm.v1.request:Request.mm_features",
    "vllm.multimodal.inputs:MultiModalFeatureSpec.identifier",
    "vllm.multimodal.inputs:MultiModalFeatureSpec.mm_position",
    "vllm.multimodal.inputs:PlaceholderRange.offset",
    "vllm.multimodal.inputs:PlaceholderRange.length",
    "vllm.v1.engine:EngineCoreOutput.prefill_stats",
    "vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens",
    "vllm.v1.core.sched.output:SchedulerOutput.scheduled_spec_decode_tokens",
    "vllm.v1.outputs:ModelRunnerOutput.sampled_token_ids",
    "vllm.v1.kv_cache_interface:KVCacheConfig.kv_cache_groups",
    "vllm.v1.kv_cache_interface:KVCacheConfig.num_blocks",
    "vllm.v1.kv_cache_interface:KVCacheGroupSpec.kv_cache_spec",
    "vllm.v1.kv_cache_interface:MambaSpec",
    "vllm.v1.kv_cache_interface:SlidingWindowSpec",
    "vllm.v1.kv_cache_interface:ChunkedLocalAttentionSpec",
    "vllm.v1.kv_cache_interface:MLAAttentionSpec",
    "vllm.config:CacheConfig.block_size",
    "vllm.config:CacheConfig.enable_prefix_caching",
    "vllm.config:CacheConfig.prefix_caching_hash_algo",
    "vllm.config:CacheConfig.prefix_cache_retention_interval",
    "vllm.config:CacheConfig.mamba_cache_mode",
    "vllm.config:SchedulerConfig.max_num_batched_tokens",
    "vllm.config:SchedulerConfig.max_num_seqs",
    "vllm.config:SchedulerConfig.enable_chunked_prefill",
    "vllm.config:SchedulerConfig.async_scheduling",
    "vllm.config:SchedulerConfig.policy",
    "vllm.config:SchedulerConfig.scheduler_cls",
    "vllm.config:SpeculativeConfig.method",
    "vllm.config:SpeculativeConfig.num_speculative_tokens",
)

STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"

# What the recording connector (.connector) uses, checked when a connector is on.
CONNECTOR_HOOKS: tuple[str, ...] = (
    "vllm.distributed.kv_transfer.kv_connector.factory:"
    "KVConnectorFactory.get_connector_class_by_name",
    f"{STORE}.connector:MooncakeStoreConnector.build_connector_meta(scheduler_output)",
    f"{STORE}.connector:MooncakeStoreConnector.bind_connector_metadata(connector_metadata)",
    f"{STORE}.connector:MooncakeStoreConnector.shutdown",
    f"{STORE}.connector:MooncakeStoreConnector.connector_worker",
    f"{STORE}.worker:MooncakeStoreWorker.store",
    f"{STORE}.worker:MooncakeStoreWorker.lookup",
    "vllm.distributed.parallel_state:get_world_group",
)

_HOOK = re.compile(r"^([\w.]+):([\w.]+)(?:\(([\w, ]*)\))?$")


@dataclass(frozen=True)
class Hook:
    module: str
    path: tuple[str, ...]          # attribute names from the module down
    params: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> "Hook":
        m = _HOOK.match(text)
        if m is None:
            raise ValueError(f"bad hook {text!r}: expected module:Name.attr[(params)]")
        params = tuple(p.strip() for p in (m.group(3) or "").split(",") if p.strip())
        return cls(m.group(1), tuple(m.group(2).split(".")), params)

    def __str__(self) -> str:
        return f"{self.module}.{'.'.join(self.path)}"


def _declared(cls: type, name: str) -> bool:
    """``name`` declared on ``cls`` without being a class attribute: a field
    (annotations, msgspec ``__struct_fields__``) or ``self.name`` assigned in the
    source of the class or a base."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}) or \
                name in getattr(klass, "__struct_fields__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=", source):
            return True
    return False


def _find(hook: Hook) -> object:
    """The object ``hook`` names; LookupError when it is not there."""
    try:
        obj: object = importlib.import_module(hook.module)
    except ImportError as exc:
        raise LookupError(f"module {hook.module} does not import ({exc})") from None
    for i, name in enumerate(hook.path):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type) and i == len(hook.path) - 1 and _declared(obj, name):
            return None
        else:
            raise LookupError("not found")
    return obj


def _missing_params(fn: object, params: tuple[str, ...]) -> list[str]:
    try:
        names = inspect.signature(fn).parameters      # type: ignore[arg-type]
    except (TypeError, ValueError):
        return list(params)
    return [p for p in params if p not in names]


def missing_hooks(extra: tuple[str, ...] = (), connector: bool = False) -> list[str]:
    """Each hook the running vLLM lacks, one line each (empty: all there).
    ``extra``: an adapter's own hooks; ``connector``: the store connector's."""
    wanted = SCHEDULER_HOOKS + tuple(extra) + (CONNECTOR_HOOKS if connector else ())
    missing = []
    for text in wanted:
        hook = Hook.parse(text)
        try:
            obj = _find(hook)
        except LookupError as exc:
            why = str(exc)
            missing.append(str(hook) if why == "not found" else f"{hook}: {why}")
            continue
        lost = _missing_params(obj, hook.params) if hook.params else []
        if lost:
            missing.append(f"{hook} (no parameter {', '.join(lost)})")
    return missing
