"""The MooncakeStore connector inside a vLLM 0.29-0.33 replay: seams and wiring.

The store adapter of every release the replay serves (``STORE_ADAPTERS``).
The store's internals were rewritten between 0.29 and 0.32 (the scheduler's
boundary puts, the coordinator's masks, the worker's tail puts: the #56615
fix lands in 0.32), but everything the seams below touch is the same in
0.29.0, 0.30.0, 0.31.0, 0.32.0 and 0.33.0, read in each release's sources:
``LookupKeyClient`` (byte-identical), the lookup server's
``store_worker.lookup(num_tokens, BlobBlockHashes(blob, hash_len))``, the
wire encoding in ``store/protocol.py`` (identical), the worker's
``recv_request_queue`` and ``kv_send_thread.request_queue``,
``register_kv_caches``, ``ensure_kv_transfer_initialized``, and keys of the
form ``...@group:N@...@HASH``. The one difference this module met is its own:
``KVCacheConfig.hash_block_size`` exists from 0.32 on, so it reads the
scheduler's ``hash_block_size`` (present in all five). Each release's
connector therefore runs as that release wrote it. :class:`StoreConnectorEngine`
is the shared driver plus the connector; each release range's engine adapter
builds its config and specs.

What runs is vLLM's own connector code on both sides: the scheduler-side
``MooncakeStoreConnector`` (``get_num_new_matched_tokens``,
``build_connector_meta``, the coordinator's masks and EAGLE margins) is built by
the real ``Scheduler``; the worker side is the real ``MooncakeStoreWorker``
(key computation, boundary puts for Mamba, the send and receive threads),
created through ``ensure_kv_transfer_initialized`` as a GPU worker does, and
stepped through ``KVConnectorModelRunnerMixin._get_kv_connector_output``.

Seams, and only these:

* **Lookup channel.** The scheduler's ZMQ ``LookupKeyClient`` is replaced by
  :class:`InProcessLookupClient`, which encodes and decodes the same wire
  messages and calls the worker's ``lookup`` directly.
* **Bytes.** KV caches are small CPU tensors (one ``uint8`` page per block,
  filled with deterministic noise) registered with the store, so puts and gets
  move real bytes. ``torch.cuda.Event`` is a no-op stand-in on a CPU.
* **Store backend.** ``--store memory`` puts :class:`MemoryStore` where
  ``mooncake.store.MooncakeDistributedStore`` would be; ``--store mooncake``
  keeps the real client against a real master. Either way a
  :class:`RecordingStore` records every operation.
* **Completion order.** Transfers run on the worker's own threads; after each
  step's ``start_load_kv`` the loads are drained before saves are queued, and
  the saves are drained before ``get_transfer_results``. So every save or load
  issued in step *s* is reported in step *s*, in one fixed order.
* **Distribution.** A real one-rank gloo world answers the rank helpers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    decode_lookup_response, encode_lookup_response)
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import KVConnectorOutput

from traces.engine_spec import EngineBlock

from ..store import StoreError, StoreSpec
from .core_driver import CoreEngine, NullExecutor
from ..store.master import MasterProcess, wait_reachable
from ..store.memory import MemoryStore, ReplicateConfig
from ..store.recording import RecordingStore

CONNECTOR_NAMES = {"mooncake_store": "MooncakeStoreConnector"}
SEGMENT_BYTES = 4 * 1024 ** 3   # the real pool (Mooncake's default), touched lazily; --store-capacity
LOCAL_BUFFER_BYTES = 64 * 1024 * 1024


def kv_transfer_config(engine: EngineBlock) -> KVTransferConfig:
    extra = dict(engine.connector_config)
    return KVTransferConfig(kv_connector=CONNECTOR_NAMES[engine.connector],
                            kv_role="kv_both", kv_connector_extra_config=extra)


class _NoopCudaEvent:
    """``wait_for_save`` records a CUDA event to fence the forward; a CPU has none."""

    def record(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class InProcessLookupClient:
    """The scheduler's lookup channel, as a direct call to the worker (the ZMQ seam)."""

    def __init__(self, session: "StoreSession") -> None:
        self.session = session

    def lookup(self, req_id: str, num_tokens: int, block_hashes, non_block: bool = False):
        hashes = list(block_hashes)
        hash_len = len(hashes[0]) if hashes else 0
        blob = memoryview(b"".join(hashes))
        store = self.session.recorder
        store.phase = "lookup"
        try:
            result = self.session.worker.lookup(num_tokens, BlobBlockHashes(blob, hash_len))
        finally:
            store.phase = "exists"
        result = decode_lookup_response(encode_lookup_response(result))
        store.ops.lookups.append({"request": req_id, "num_tokens": num_tokens,
                                  "hit_length": int(result.hit_length), "step": store.step})
        return result

    def discard(self, req_id: str) -> None:
        return None

    def reset(self) -> bool:
        worker = self.session.worker
        if worker.kv_send_thread is not None:
            worker.kv_send_thread.request_queue.join()
        worker.store.remove_all(force=True)
        return True

    def close(self) -> None:
        return None


class StoreSession:
    """Everything a connector adds to one replay: env, master, store, worker connector."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.tmp = Path(tempfile.mkdtemp(prefix="replayer-store-"))
        self.master: MasterProcess | None = None
        self.recorder: RecordingStore | None = None
        self.connector = None
        self.worker = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._env_before: dict[str, str | None] = {}
        if spec.kind == "mooncake":
            if spec.host is None:
                self.master = MasterProcess()
                address = self.master.address
            else:
                wait_reachable(spec.host, spec.port)
                address = f"{spec.host}:{spec.port}"
            self.label = f"mooncake://{address}"
        else:
            address = "127.0.0.1:1"      # never contacted
            self.label = "memory"
        self._segment = spec.capacity_bytes or SEGMENT_BYTES
        config = {"metadata_server": "P2PHANDSHAKE", "master_server_address": address,
                  "protocol": "tcp", "device_name": "", "mode": "embedded",
                  "global_segment_size": self._segment,
                  "local_buffer_size": LOCAL_BUFFER_BYTES}
        cfg_path = self.tmp / "mooncake.json"
        cfg_path.write_text(json.dumps(config))
        self._set_env({
            "MOONCAKE_CONFIG_PATH": str(cfg_path),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_RPC_BASE_PATH": str(self.tmp),
            # One receive thread: loads of a step complete in one fixed order.
            "VLLM_MOONCAKE_LOAD_RECV_THREADS": "1",
        })

    def _set_env(self, values: dict[str, str]) -> None:
        for k, v in values.items():
            self._env_before.setdefault(k, os.environ.get(k))
            os.environ[k] = v

    # -- worker side ----------------------------------------------------
    def init_worker(self, vllm_config: VllmConfig, kv_cache_config: Any,
                    boundary_of) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized, get_kv_transfer_group)

        _init_one_rank_world(vllm_config, self.tmp)
        if not torch.cuda.is_available():
            torch.cuda.Event = _NoopCudaEvent  # type: ignore[assignment,misc]
        log = self.tmp / "mooncake-client.log"
        try:
            with self._store_module(), _start_up_log(log):
                ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
        except RuntimeError as exc:
            raise StoreError(f"store {self.label}: could not start the Mooncake client "
                             f"({exc}; is the pool of {self._segment} bytes too small? "
                             f"client log: {log})") from None
        self.connector = get_kv_transfer_group()
        self.worker = self.connector.connector_worker
        self.recorder = RecordingStore(self.worker.store, self.label, boundary_of=boundary_of)
        self.worker.store = self.recorder
        self.kv_caches = _allocate_kv_caches(kv_cache_config)
        self.connector.register_kv_caches(self.kv_caches)
        self._wrap_for_fixed_order()
        self._name_loaders()

    @contextmanager
    def _store_module(self):
        """For ``--store memory``: the worker imports our store as mooncake.store."""
        if self.spec.kind != "memory":
            yield
            return
        saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.store")}
        pkg = types.ModuleType("mooncake")
        mod = types.ModuleType("mooncake.store")
        mod.MooncakeDistributedStore = lambda: MemoryStore(self.spec.capacity_bytes)
        mod.ReplicateConfig = ReplicateConfig
        pkg.store = mod
        sys.modules["mooncake"], sys.modules["mooncake.store"] = pkg, mod
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v

    def _wrap_for_fixed_order(self) -> None:
        worker = self.worker
        wait_for_save = self.connector.wait_for_save

        def drained_wait_for_save(*args, **kwargs):
            worker.recv_request_queue.join()          # loads of this step first
            wait_for_save(*args, **kwargs)
            if worker.kv_send_thread is not None:
                worker.kv_send_thread.request_queue.join()

        self.connector.wait_for_save = drained_wait_for_save

    def _name_loaders(self) -> None:
        """Each receive thread tells the recorder whose load it runs, so every get
        is filed under the request that fetched it (``expect_store.gets``)."""
        recorder = self.recorder
        for thread in self.worker.kv_recv_threads:
            handle = thread._handle_request

            def named(req_meta, handle=handle):
                recorder.loading(req_meta.req_id)
                try:
                    return handle(req_meta)
                finally:
                    recorder.loading(None)

            thread._handle_request = named

    def remove(self, selectors: tuple[tuple[str, int | None, int | None], ...]) -> list[str]:
        """Remove the keys written so far that match each (request, group, boundary)
        selector (None matches any), through the store's own ``remove``; a selector
        matching no written key is an error."""
        puts = [r for r in self.recorder.ops.rows if r["op"] == "put" and r["result"] >= 0]
        keys: list[str] = []
        for request, group, boundary in selectors:
            found = [r["key"] for r in puts if r["request"] == request
                     and (group is None or r["group"] == group)
                     and (boundary is None or r["boundary"] == boundary)]
            if not found:
                what = f"request {request!r}" + ("" if group is None else f" group {group}") + (
                    "" if boundary is None else f" @ {boundary}")
                raise StoreError(f"store {self.label}: store_remove: no key of {what} "
                                 "was written")
            keys += [k for k in found if k not in keys]
        worker = self.worker
        if worker.kv_send_thread is not None:
            worker.kv_send_thread.request_queue.join()
        for key in keys:
            self.recorder.remove(key, True)      # force: as remove_all, never lease-bound
        self.check()
        return keys

    def execute(self, scheduler_output, vllm_config: VllmConfig) -> KVConnectorOutput:
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        with set_forward_context(None, vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as out:
            pass                                       # the model's forward: nothing
        return out

    # -- scheduler side ---------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        conn = scheduler.connector
        sched_side = conn.connector_scheduler
        sched_side.client.close()
        sched_side.client = InProcessLookupClient(self)

    def check(self) -> None:
        if self.recorder is not None:
            failures = self.recorder.take_failures()
            if failures:
                raise StoreError(failures[0] + (f" (and {len(failures) - 1} more)"
                                                 if len(failures) > 1 else ""))

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        try:
            ensure_kv_transfer_shutdown()
        except Exception:  # noqa: BLE001 - closing a dead master's client may fail
            pass
        if self.master is not None:
            self.master.close()
        for k, v in self._env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _start_up_log(path: Path):
    """The Mooncake client logs its start-up (glog, before any level applies) to
    stderr; keep it in a file unless --verbose."""
    if os.environ.get("PREFIX_REPLAYER_VERBOSE") == "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as fh:
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _allocate_kv_caches(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """One dense ``[num_blocks, page]`` byte tensor per layer, deterministic noise."""
    n = kv_cache_config.num_blocks
    gen = torch.Generator().manual_seed(0)
    caches: dict[str, torch.Tensor] = {}
    for group in kv_cache_config.kv_cache_groups:
        page = group.kv_cache_spec.page_size_bytes
        for name in group.layer_names:
            caches[name] = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=gen)
    return caches


def _init_one_rank_world(vllm_config: VllmConfig, tmp: Path) -> None:
    """A real single-rank gloo world, so vLLM's rank helpers answer rank 0 of 1.

    EngineCore's shutdown tears the groups down, so each engine builds them anew.
    """
    import torch.distributed as dist

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        if not dist.is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"file://{tmp}/dist-init-{os.getpid()}")
        initialize_model_parallel(1, 1)


class StoreAwareExecutor(NullExecutor):
    """The null executor, plus the worker-side MooncakeStore connector when the
    trace has one (created where a GPU worker creates it: on KV-cache init)."""

    adapter: "StoreConnectorEngine"

    def _rpc_initialize_from_config(self, kv_cache_configs: Any) -> None:
        super()._rpc_initialize_from_config(kv_cache_configs)
        session = self.adapter.session
        if session is not None:
            session.init_worker(self.vllm_config, kv_cache_configs[0],
                                self.adapter.boundaries.get)


class StoreConnectorEngine(CoreEngine):
    """The shared driver, plus the MooncakeStore connector when the trace has one.

    ``config`` must name :class:`StoreAwareExecutor` as its executor backend."""

    def __init__(self, config: Any, layer_specs: dict[str, Any], version: str,
                 engine: EngineBlock, store: StoreSpec | None = None) -> None:
        self.session: StoreSession | None = None
        # Block hash (hex) -> (token boundary, first request): names store keys.
        self.boundaries: dict[str, tuple[int, str]] = {}
        if engine.connector:
            self.session = StoreSession(store or StoreSpec("memory"))
        try:
            super().__init__(config, layer_specs, version, executor_cls=StoreAwareExecutor)
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        # The scheduler's own hash block size (KVCacheConfig carries it from 0.32 on).
        self._hash_block_size = self.scheduler.hash_block_size or 1
        if self.session is not None:
            self.session.attach_scheduler(self.scheduler)

    # -- hooks into the shared driver ------------------------------------
    def _kv_output(self, scheduler_output):
        if self.session is None:
            return None
        return self.session.execute(scheduler_output, self.config)

    def _on_preprocessed(self, req, request) -> None:
        if self.session is not None:
            # Store keys name block hashes; remember which token boundary each
            # ends at, and the first request that had that prefix.
            hbs = self._hash_block_size
            for i, h in enumerate(req.block_hashes):
                self.boundaries.setdefault(bytes(h).hex(), ((i + 1) * hbs, request.id))

    def _before_step(self) -> None:
        if self.session is not None:
            self.session.recorder.step = self._step

    def _after_step(self) -> None:
        if self.session is not None:
            self.session.check()

    def reset_prefix_cache(self) -> bool:
        # The GPU-side cache only: the store keeps its keys, as in production.
        return super().reset_prefix_cache()

    def store_remove(self, keys: tuple[tuple[str, int | None, int | None], ...]) -> list[str]:
        if self.session is None:
            return super().store_remove(keys)
        self.session.recorder.step = self._step
        removed = self.session.remove(keys)
        self._recorded({"action": "store_remove", "keys": [
            {"request": r, "group": g, "boundary": b} for r, g, b in keys]})
        return removed

    def store_report(self) -> dict[str, Any] | None:
        """Store operations recorded so far (None without a connector)."""
        if self.session is None:
            return None
        ops = self.session.recorder.ops
        return {"backend": self.session.spec.kind, "rows": list(ops.rows),
                "lookups": list(ops.lookups), "seconds": self.session.recorder.seconds}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.session is not None:
                self.session.close()
