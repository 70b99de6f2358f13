"""vLLM's OffloadingConnector (CPU offload) inside a vLLM 0.32-0.34 replay: seams and wiring.

``engine.connector: offloading`` replays vLLM's own ``OffloadingConnector``
(``kv_connector_extra_config`` by vLLM's names: ``cpu_bytes_to_use``,
``block_size`` or ``blocks_per_chunk``, ``spec_name``, ``eviction_policy``
lru | arc, ``store_threshold``, ``offload_prompt_only``, ...). What runs is
vLLM's code on both sides: the scheduler builds the real
``OffloadingConnectorScheduler`` with its ``CPUOffloadingManager`` and LRU or
ARC policy (lookups chunk by chunk, the EAGLE and Mamba rules, store jobs
deferred a step, loads, evictions); the worker side is the real
``OffloadingConnectorWorker`` (job bookkeeping, stores deferred to the next
step's ``start_kv_transfers``, completion metadata), created where a GPU
worker creates it and stepped through ``KVConnectorModelRunnerMixin``.

Seams, and only these:

* **The transfer handler.** vLLM's ``CPUOffloadingWorker`` copies blocks
  between GPU and pinned CPU memory on CUDA streams (it refuses any other
  platform). :class:`FinishedTransfers` stands in its place: every store and
  load submitted in a step is reported finished, successfully, by that step's
  ``get_finished``, in submission order. No byte moves, so
  ``register_kv_caches`` (which derives the CPU layout from real KV tensors)
  is not run either.
* **Completion order.** As for the store: every transfer finishes in the step
  that submitted it; a real DMA may finish one or more steps later.

The scheduler's manager is wrapped (never replaced) so that each lookup,
load, store and eviction becomes a ``store_ops`` row, keyed
``cpu@group:G@HASH`` and named by request and boundary like a store key.
"""

from __future__ import annotations

from typing import Any

from vllm.config import KVTransferConfig, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.kv_offload.base import LookupResult, TransferResult, get_offload_block_hash, \
    get_offload_group_idx
from vllm.v1.outputs import KVConnectorOutput

from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.store import StoreError, StoreSpec
from replayer.replay.store.recording import StoreOps
from traces.model.engine_spec import EngineBlock

CONNECTOR_NAME = "OffloadingConnector"
# vLLM's KVTransferConfig draws a random engine_id when none is given; the CPU
# tier's names carry it, so a replay fixes it.
ENGINE_ID = "prefix-replayer"
# The one spec whose manager runs in the scheduler alone (TieringOffloadingSpec
# composes tiers with their own threads and files: not replayed).
SPECS = ("CPUOffloadingSpec",)
# Releases whose worker resolves each transfer's device pointers from the KV
# caches it registered (resolve_device_pointers, 0.34): there the replay registers
# small CPU tensors through vLLM's own register_kv_caches, the transfer handler
# still the seam; before, no byte layout is read and registering is skipped.
REGISTERS_KV_CACHES = ("0.34",)
# The store_ops ``result`` of a per-key lookup row, by vLLM's LookupResult.
LOOKUP_CODES = {LookupResult.MISS: 0, LookupResult.HIT: 1, LookupResult.HIT_PENDING: 2,
                LookupResult.RETRY: 3}


def kv_transfer_config(engine: EngineBlock) -> KVTransferConfig:
    """vLLM's ``KVTransferConfig`` for ``connector: offloading`` (``kv_both``, as
    vLLM runs it; its ``connector_config`` is the ``kv_connector_extra_config``)."""
    extra = dict(engine.connector_config)
    spec = extra.get("spec_name", SPECS[0])
    if spec not in SPECS:
        raise UnsupportedByEngine(
            f"engine.connector_config.spec_name {spec!r}: only {', '.join(SPECS)} is "
            "replayed (its manager runs in the scheduler alone)")
    policy = {} if engine.kv_load_failure_policy is None else {
        "kv_load_failure_policy": engine.kv_load_failure_policy}
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both",
                            engine_id=ENGINE_ID, kv_connector_extra_config=extra, **policy)


def offload_key_name(key: bytes) -> str:
    """A CPU-tier key as a ``store_ops`` key: ``cpu@group:G@HASH``."""
    return f"cpu@group:{get_offload_group_idx(key)}@{get_offload_block_hash(key).hex()}"


class FinishedTransfers:
    """The transfer-handler seam (vLLM's ``OffloadingWorker`` interface): each job
    submitted is finished, successfully, at the next ``get_finished``."""

    def __init__(self) -> None:
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        self._done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None             # every submitted job is already done

    def shutdown(self) -> None:
        self._done.clear()


class RecordedManager:
    """Records what vLLM's scheduler asks its offloading manager, as store_ops
    rows; wraps the manager's own methods, which still decide everything."""

    def __init__(self, manager: Any, ops: StoreOps, boundary_of) -> None:
        self.manager = manager
        self.ops = ops
        self.boundary_of = boundary_of
        self.step = 0
        for name in ("lookup", "prepare_load", "prepare_store", "complete_store"):
            setattr(manager, name, getattr(self, "_" + name)(getattr(manager, name)))

    def row(self, op: str, key: bytes, result: int, loader: str | None = None) -> None:
        name = offload_key_name(key)
        site = self.boundary_of(get_offload_block_hash(key).hex())
        boundary, request = site if site else (None, None)
        self.ops.rows.append({
            "order": len(self.ops.rows), "step": self.step, "rank": 0, "op": op, "key": name,
            "group": get_offload_group_idx(key), "boundary": boundary, "bytes": None,
            "result": result, "request": request, "loader": loader,
            # A time segment's: how many names were filed before it (segments/rows.py).
            **({} if self.ops.mark is None else {"names": self.ops.mark()})})

    def _lookup(self, inner):
        def lookup(key, req_context):
            result = inner(key, req_context)
            self.row("lookup", key, LOOKUP_CODES.get(result, -1))
            return result
        return lookup

    def _prepare_load(self, inner):
        def prepare_load(keys, req_context):
            spec = inner(keys, req_context)
            for key in keys:
                self.row("get", key, 0, loader=req_context.req_id)
            return spec
        return prepare_load

    def _prepare_store(self, inner):
        def prepare_store(keys, req_context):
            out = inner(keys, req_context)
            for key in (out.evicted_keys if out is not None else ()):
                self.row("evict", key, 0)
            return out
        return prepare_store

    def _complete_store(self, inner):
        def complete_store(keys, req_context, success=True):
            inner(keys, req_context, success)
            for key in keys:
                self.row("put", key, 0 if success else -1)
        return complete_store


class OffloadSession:
    """What ``connector: offloading`` adds to one replay: the worker-side
    connector over :class:`FinishedTransfers`, and the scheduler's manager recorded."""

    backend = "cpu"

    def __init__(self, engine: EngineBlock, store: StoreSpec | None,
                 version: str = "0.33.0") -> None:
        self.version = version
        if store is not None and store.kind != "memory":
            raise UnsupportedByEngine(
                f"engine.connector offloading keeps its blocks in vLLM's own CPU tier: "
                f"--store {store.label()} does not apply to it")
        if engine.tensor_parallel_size != 1 or engine.decode_context_parallel_size != 1:
            raise UnsupportedByEngine(
                "engine.connector offloading is replayed at one rank (tensor_parallel_size "
                "and decode_context_parallel_size 1)")
        self.label = "cpu offload"
        self.spec = StoreSpec("memory")
        self.ops = StoreOps()
        self.ranks: list[Any] = []
        self.connector: Any = None
        self.recorded: RecordedManager | None = None
        self._boundary_of = None
        self._config: VllmConfig | None = None

    # -- worker side ----------------------------------------------------
    def init_worker(self, vllm_config: VllmConfig, kv_cache_config: Any,
                    boundary_of) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        self._boundary_of = boundary_of
        self._config = vllm_config
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER,
                                             kv_cache_config)
        # The transfer-handler seam in place of spec.get_worker(kv_caches).
        worker = self.connector.connector_worker
        from replayer.replay.engines import release_prefix

        if release_prefix(self.version, REGISTERS_KV_CACHES) is None:
            worker.worker = FinishedTransfers()
            return
        from replayer.replay.engines.connector.mooncake_ranks import allocate_kv_caches

        worker.spec.get_worker = lambda kv_caches: FinishedTransfers()
        self.connector.register_kv_caches(allocate_kv_caches(kv_cache_config))

    def adopt_worker(self, connector: Any, boundary_of) -> None:
        """On the model worker: the connector vLLM's own worker created (its
        transfer handler already the seam, :mod:`replayer.replay.engines.worker.offload`),
        which vLLM's runner steps; :meth:`execute` is then not called."""
        self._boundary_of = boundary_of
        self.connector = connector

    def execute(self, scheduler_output, vllm_config: VllmConfig,
                step: Any = None) -> KVConnectorOutput:
        """One step of the worker-side connector, as vLLM's GPU model runner
        drives it: ``handle_preemptions``, then the connector's step around the
        (absent) forward. ``step``: 0.34's runner step (the store adapter's
        ``connector_step``), which calls ``handle_preemptions`` itself; None:
        0.32-0.33's runner mixin."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        before = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            if step is not None:
                return step(self.connector, scheduler_output, vllm_config)
            from vllm.v1.worker.kv_connector_model_runner_mixin import (
                KVConnectorModelRunnerMixin,
            )

            self.connector.handle_preemptions(scheduler_output.kv_connector_metadata)
            with set_forward_context(None, vllm_config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as out:
                pass                                       # the model's forward: nothing
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = before
        return out

    # -- scheduler side ---------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        sched = scheduler.connector.connector_scheduler
        self.recorded = RecordedManager(sched.manager, self.ops, self._boundary_of)
        matched = sched.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs):
            first = len(self.ops.rows)
            hit, load_async = matched(request, num_computed_tokens, *args, **kwargs)
            if hit is not None:             # None: vLLM asks again at a later step
                self.ops.lookups.append({
                    "request": request.request_id, "num_tokens": request.num_tokens,
                    "hit_length": num_computed_tokens + hit, "step": self.recorded.step,
                    "rows": [first, len(self.ops.rows)]})
            return hit, load_async

        sched.get_num_new_matched_tokens = get_num_new_matched_tokens

    def set_step(self, step: int) -> None:
        if self.recorded is not None:
            self.recorded.step = step

    def check(self) -> None:
        return None

    def remove(self, selectors) -> list[str]:
        raise StoreError("store_remove names MooncakeStore keys; engine.connector offloading "
                         "has no store to remove them from")

    def arm_fault(self, op, selectors, code, times, step) -> None:
        raise StoreError("store_fault injects MooncakeStore error codes; engine.connector "
                         "offloading has no store client to inject them into")

    def close(self) -> None:
        if self.connector is not None:
            try:
                self.connector.shutdown()
            except Exception:  # noqa: BLE001 - nothing to lose at close
                pass
