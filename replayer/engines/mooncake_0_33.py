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
* **Distribution.** A real one-rank gloo world answers the collective helpers.
  With ``tensor_parallel_size`` N > 1 (DCP a subdivision of it) the replay
  builds N real worker connectors in this one process, each while the rank
  helpers the worker reads at construction (``get_tensor_model_parallel_rank``
  and ``_world_size``, ``get_dcp_group``, ``get_pcp_group``,
  ``parallel_config.rank``) answer that rank; each has its own KV tensors and
  Mooncake client over one shared backend, and writes and looks up its own
  keys. The ranks step one after another, each with its own copy of the
  scheduler output (as each worker process unpickles one), and vLLM's own
  ``KVOutputAggregator`` merges their outputs as the multiprocess executor
  does. The lookup and reset go to rank 0, as vLLM's lookup server does.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from traces.store_codes import code_name

from ..store import StoreError, StoreSpec
from ..schedule import KeySelector
from .core_driver import CoreEngine, NullExecutor
from ..store.master import MasterProcess, wait_reachable
from ..store.memory import MemoryStore, ReplicateConfig
from ..store.recording import Fault, RecordingStore, StoreOps

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"

CONNECTOR_NAMES = {"mooncake_store": "MooncakeStoreConnector"}
SEGMENT_BYTES = 4 * 1024 ** 3   # the real pool (Mooncake's default), touched lazily; --store-capacity
LOCAL_BUFFER_BYTES = 64 * 1024 * 1024


def kv_transfer_config(engine: EngineBlock) -> KVTransferConfig:
    extra = dict(engine.connector_config)
    policy = {} if engine.kv_load_failure_policy is None else {
        "kv_load_failure_policy": engine.kv_load_failure_policy}
    return KVTransferConfig(kv_connector=CONNECTOR_NAMES[engine.connector],
                            kv_role="kv_both", kv_connector_extra_config=extra, **policy)


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
        self.session.drain_saves()
        self.session.worker.store.remove_all(force=True)     # rank 0, as vLLM's server
        return True

    def close(self) -> None:
        return None


@dataclass
class WorkerRank:
    """One worker rank: its real connector, the store worker inside it, the
    recorder in front of its store client, and its own KV tensors."""

    rank: int
    connector: Any
    worker: Any
    recorder: RecordingStore
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)


class StoreSession:
    """Everything a connector adds to one replay: env, master, store, worker connectors."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.tmp = Path(tempfile.mkdtemp(prefix="replayer-store-"))
        self.master: MasterProcess | None = None
        self.ranks: list[WorkerRank] = []
        self.ops = StoreOps()
        self._aggregator = None
        self._memory: MemoryStore | None = None     # --store memory: one backend, all ranks
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

    # rank 0: what the scheduler's lookup and the events talk to
    @property
    def worker(self) -> Any:
        return self.ranks[0].worker

    @property
    def recorder(self) -> RecordingStore | None:
        return self.ranks[0].recorder if self.ranks else None

    def set_step(self, step: int) -> None:
        for r in self.ranks:
            r.recorder.step = step

    def drain_saves(self) -> None:
        for r in self.ranks:
            if r.worker.kv_send_thread is not None:
                r.worker.kv_send_thread.request_queue.join()

    # -- worker side ----------------------------------------------------
    def init_worker(self, vllm_config: VllmConfig, kv_cache_config: Any,
                    boundary_of) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized, get_kv_transfer_group)

        _init_one_rank_world(vllm_config, self.tmp)
        if not torch.cuda.is_available():
            torch.cuda.Event = _NoopCudaEvent  # type: ignore[assignment,misc]
        par = vllm_config.parallel_config
        tp, dcp = par.tensor_parallel_size, par.decode_context_parallel_size
        log = self.tmp / "mooncake-client.log"
        for rank in range(tp):
            try:
                with self._store_module(), _start_up_log(log), \
                        _as_rank(vllm_config, rank, tp, dcp):
                    if rank == 0:
                        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
                        connector = get_kv_transfer_group()
                    else:
                        connector = _create_worker_connector(vllm_config, kv_cache_config)
            except RuntimeError as exc:
                raise StoreError(f"store {self.label}: could not start the Mooncake client "
                                 f"of rank {rank} ({exc}; is the pool of {self._segment} "
                                 f"bytes too small? client log: {log})") from None
            worker = connector.connector_worker
            recorder = RecordingStore(worker.store, self.label, rank=rank,
                                      boundary_of=boundary_of, ops=self.ops)
            worker.store = recorder
            one = WorkerRank(rank, connector, worker, recorder,
                             _allocate_kv_caches(kv_cache_config, seed=rank))
            connector.register_kv_caches(one.kv_caches)
            self.ranks.append(one)
            self._wrap_for_fixed_order(one)
            self._name_loaders(one)
        if tp > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self._aggregator = KVOutputAggregator.from_connector(self.ranks[0].connector, tp)

    @contextmanager
    def _store_module(self):
        """For ``--store memory``: the worker imports our store as mooncake.store."""
        if self.spec.kind != "memory":
            yield
            return
        saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.store")}
        pkg = types.ModuleType("mooncake")
        mod = types.ModuleType("mooncake.store")
        if self._memory is None:
            self._memory = MemoryStore(self.spec.capacity_bytes)
        mod.MooncakeDistributedStore = lambda: self._memory
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

    @staticmethod
    def _wrap_for_fixed_order(one: WorkerRank) -> None:
        worker = one.worker
        wait_for_save = one.connector.wait_for_save

        def drained_wait_for_save(*args, **kwargs):
            worker.recv_request_queue.join()          # loads of this step first
            wait_for_save(*args, **kwargs)
            if worker.kv_send_thread is not None:
                worker.kv_send_thread.request_queue.join()

        one.connector.wait_for_save = drained_wait_for_save

    @staticmethod
    def _name_loaders(one: WorkerRank) -> None:
        """Each receive thread tells the recorder whose load it runs, so every get
        is filed under the request that fetched it (``expect_store.gets``)."""
        recorder = one.recorder
        for thread in one.worker.kv_recv_threads:
            handle = thread._handle_request

            def named(req_meta, handle=handle):
                recorder.loading(req_meta.req_id)
                try:
                    return handle(req_meta)
                finally:
                    recorder.loading(None)

            thread._handle_request = named

    def remove(self, selectors: tuple[KeySelector, ...]) -> list[str]:
        """Remove the keys written so far that match each (request, group, boundary,
        rank) selector (None matches any), each through the store client of the
        rank that wrote it; a selector matching no written key is an error."""
        self.drain_saves()
        puts = [r for r in self.ops.rows if r["op"] == "put" and r["result"] >= 0]
        keys: list[tuple[str, int]] = []
        for request, group, boundary, rank_ in selectors:
            found = [(r["key"], r["rank"]) for r in puts if r["request"] == request
                     and (group is None or r["group"] == group)
                     and (boundary is None or r["boundary"] == boundary)
                     and (rank_ is None or r["rank"] == rank_)]
            if not found:
                what = f"request {request!r}" + ("" if group is None else f" group {group}") + (
                    "" if boundary is None else f" @ {boundary}") + (
                    "" if rank_ is None else f" on rank {rank_}")
                raise StoreError(f"store {self.label}: store_remove: no key of {what} "
                                 "was written")
            keys += [k for k in found if k not in keys]
        for key, rank_ in keys:      # each removed by the rank that wrote it
            # force: as remove_all, never lease-bound
            self.ranks[rank_].recorder.remove(key, True)
        self.check()
        return [k for k, _ in keys]

    def arm_fault(self, op: str, selectors: tuple[KeySelector, ...], code: int, times: int,
                  step: int) -> None:
        """From now on the next ``times`` ops ``op`` on matching keys return ``code``.
        A selector naming a rank this replay does not run is an error."""
        for request, _, _, rank in selectors:
            if rank is not None and rank >= len(self.ranks):
                raise StoreError(f"store {self.label}: store_fault on rank {rank}, but the "
                                 f"replay runs {len(self.ranks)} rank(s) "
                                 "(engine.tensor_parallel_size)")
        self.drain_saves()          # faults apply to ops issued from this step on
        with self.ops.lock:
            self.ops.faults.append(Fault(op, tuple(selectors), code, times, step))

    def execute(self, scheduler_output, vllm_config: VllmConfig) -> KVConnectorOutput:
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        if len(self.ranks) == 1:
            with set_forward_context(None, vllm_config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as out:
                pass                                       # the model's forward: nothing
            return out
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.v1.outputs import ModelRunnerOutput

        outputs = []
        try:
            for one in self.ranks:
                # Each worker process unpickles its own copy of the scheduler output.
                own = copy.deepcopy(scheduler_output)
                kv_transfer_state._KV_CONNECTOR_AGENT = one.connector
                with set_forward_context(None, vllm_config), \
                        KVConnectorModelRunnerMixin._get_kv_connector_output(own) as out:
                    pass
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(out))
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = self.ranks[0].connector
        return self._aggregator.aggregate(outputs, 0).kv_connector_output

    # -- scheduler side ---------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        conn = scheduler.connector
        sched_side = conn.connector_scheduler
        sched_side.client.close()
        sched_side.client = InProcessLookupClient(self)

    def check(self) -> None:
        if self.ranks:
            failures = self.recorder.take_failures()
            if failures:
                raise StoreError(failures[0] + (f" (and {len(failures) - 1} more)"
                                                 if len(failures) > 1 else ""))

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        for one in self.ranks[1:]:           # rank 0's is the process's own
            try:
                one.connector.shutdown()
            except Exception:  # noqa: BLE001 - closing a dead master's client may fail
                pass
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


def _allocate_kv_caches(kv_cache_config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """One dense ``[num_blocks, page]`` byte tensor per layer, deterministic noise
    (seeded by rank: a get that read another rank's bytes would fail its checksum)."""
    n = kv_cache_config.num_blocks
    gen = torch.Generator().manual_seed(seed)
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


class _GroupAtRank:
    """What the worker reads of a DCP/PCP group at construction."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size = world_size
        self.rank_in_group = rank_in_group


@contextmanager
def _as_rank(vllm_config: VllmConfig, rank: int, tp: int, dcp: int):
    """The rank helpers the store worker reads in ``__init__`` answer ``rank``
    of a TP world of ``tp`` (DCP a subdivision: dcp_rank = tp_rank % dcp);
    restored after. With one rank, the real one-rank world answers as is."""
    if tp == 1:
        yield
        return
    import importlib

    mod = importlib.import_module(WORKER_MODULE)
    names = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
             "get_dcp_group", "get_pcp_group")
    saved = {n: getattr(mod, n) for n in names}
    par = vllm_config.parallel_config
    saved_rank = par.rank
    mod.get_tensor_model_parallel_rank = lambda: rank
    mod.get_tensor_model_parallel_world_size = lambda: tp
    mod.get_dcp_group = lambda: _GroupAtRank(dcp, rank % dcp)
    mod.get_pcp_group = lambda: _GroupAtRank(1, 0)
    par.rank = rank
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
        par.rank = saved_rank


def _create_worker_connector(vllm_config: VllmConfig, kv_cache_config: Any) -> Any:
    """A further rank's worker-side connector, as ``ensure_kv_transfer_initialized``
    builds rank 0's (without making it the process's one)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.WORKER,
                                               kv_cache_config=kv_cache_config)


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
            self.session.set_step(self._step)

    def _after_step(self) -> None:
        if self.session is not None:
            self.session.check()

    def reset_prefix_cache(self) -> bool:
        # The GPU-side cache only: the store keeps its keys, as in production.
        return super().reset_prefix_cache()

    def store_remove(self, keys: tuple[KeySelector, ...]) -> list[str]:
        if self.session is None:
            return super().store_remove(keys)
        self.session.set_step(self._step)
        removed = self.session.remove(keys)
        self._recorded({"action": "store_remove", "keys": [
            {"request": r, "group": g, "boundary": b, "rank": k} for r, g, b, k in keys]})
        return removed

    def store_fault(self, op: str, keys: tuple[KeySelector, ...], code: int,
                    times: int) -> None:
        if self.session is None:
            return super().store_fault(op, keys, code, times)
        self.session.arm_fault(op, keys, code, times, self._step)
        self._recorded({"action": "store_fault", "op": op, "code": code, "times": times,
                        "keys": [{"request": r, "group": g, "boundary": b, "rank": k}
                                 for r, g, b, k in keys]})

    def store_report(self) -> dict[str, Any] | None:
        """Store operations recorded so far (None without a connector), and each
        ``store_fault``: how often it fired. Called once, when the replay ends: a
        fault that fired fewer times than it was armed for adds a note."""
        if self.session is None:
            return None
        ops = self.session.ops
        faults = []
        for f in ops.faults:
            faults.append({"op": f.op, "code": f.code, "times": f.times, "fired": f.fired,
                           "step": f.step})
            if f.fired < f.times:
                what = ", ".join(f"{r}" + ("" if g is None else f" group {g}")
                                 + ("" if b is None else f" @ {b}")
                                 + ("" if k is None else f" rank {k}")
                                 for r, g, b, k in f.selectors)
                self.notes.append(f"store_fault {f.op} ({what}) armed before step {f.step} "
                                  f"fired {f.fired} of {f.times} time(s): no matching "
                                  f"{f.op} happened after it ({code_name(f.code)} unused)")
        return {"backend": self.session.spec.kind, "rows": list(ops.rows),
                "lookups": list(ops.lookups), "faults": faults,
                "seconds": sum(r.recorder.seconds for r in self.session.ranks)}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.session is not None:
                self.session.close()
