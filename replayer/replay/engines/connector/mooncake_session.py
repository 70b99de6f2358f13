"""What a MooncakeStore connector adds to one replay: env, master, store, workers.

:class:`StoreSession` starts the store backend (the in-memory store, a real
``mooncake_master`` of its own, or one already running), builds one worker
connector per rank (:mod:`.mooncake_ranks`), steps them in a fixed order, and
answers the scheduler's lookups in process (:class:`InProcessLookupClient`,
the ZMQ seam). Store events (``store_remove``, ``store_fault``) act here.
See :mod:`.mooncake_0_33` for the seams and why each is there.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    decode_lookup_response,
    encode_lookup_response,
)
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import KVConnectorOutput

from replayer.replay.engines.connector.mooncake_ranks import (
    NoopCudaEvent,
    WorkerRank,
    allocate_kv_caches,
    as_rank,
    create_worker_connector,
    init_one_rank_world,
    start_up_log,
)
from replayer.replay.schedule import KeySelector
from replayer.replay.store import StoreError, StoreSpec
from replayer.replay.store.master import MasterProcess, wait_reachable
from replayer.replay.store.memory import MemoryStore, ReplicateConfig
from replayer.replay.store.recording import Fault, RecordingStore, StoreOps

# Each rank's segment (Mooncake's default global_segment_size), touched lazily;
# --store-capacity or engine.mooncake_global_segment_size sets it.
SEGMENT_BYTES = 4 * 1024 ** 3
LOCAL_BUFFER_BYTES = 64 * 1024 * 1024


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
        first = len(store.ops.rows)
        try:
            result = self.session.worker.lookup(num_tokens, BlobBlockHashes(blob, hash_len))
        finally:
            store.phase = "exists"
        result = decode_lookup_response(encode_lookup_response(result))
        # rows: the store_ops rows this lookup made ([first, end)), so a miss can
        # be named by its group and boundary.
        if self.session.files_lookups:
            store.ops.lookups.append({"request": req_id, "num_tokens": num_tokens,
                                      "hit_length": int(result.hit_length), "step": store.step,
                                      "rows": [first, len(store.ops.rows)]})
        return result

    def prefetch(self, req_id: str, num_tokens: int, block_hashes) -> bool:
        """0.34's early lookup of a request just added (``lookup_async`` with a
        ``lookup_prefetch_limit``; the 0.34 adapter refuses such a trace): declined,
        as vLLM's own client declines one past its limit, so the lookup is made
        when the scheduler asks. Earlier releases never call it."""
        return False

    def discard(self, req_id: str) -> None:
        return None

    def reset(self) -> bool:
        self.session.drain_saves()
        self.session.worker.store.remove_all(force=True)     # rank 0, as vLLM's server
        return True

    def close(self) -> None:
        return None


# The longest TMPDIR the session's directory goes under: vLLM's lookup socket,
# "lookup_rpc_port_0_host_<hostname>_dp_rank0" in "replayer-store-XXXXXXXX",
# must stay within a Unix socket path's 107 bytes for hostnames up to ~20 chars.
SHORT_DIR_CHARS = 40


class StoreSession:
    """Everything a connector adds to one replay: env, master, store, worker connectors."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        # The client's config, log and vLLM's lookup socket: removed at close
        # unless an error named the log in it (keep_tmp). A Unix socket's path
        # holds at most 107 bytes (ZMQ refuses longer): under a TMPDIR too deep
        # for vLLM's socket name, the directory (a few small files) goes to /tmp.
        where = None if len(tempfile.gettempdir()) <= SHORT_DIR_CHARS else "/tmp"
        self.tmp = Path(tempfile.mkdtemp(prefix="replayer-store-", dir=where))
        self.keep_tmp = False
        self.master: MasterProcess | None = None
        self.ranks: list[WorkerRank] = []
        # A pair's decode instance shares the prefill instance's store and log
        # (StoreSpec.peer), and leaves the process's own connector to it.
        self.peer: StoreSession | None = spec.peer
        # Whether lookups are filed for the goldens (a pair's prefill instance's are not).
        self.files_lookups = True
        self.ops = StoreOps() if self.peer is None else self.peer.ops
        self._aggregator = None
        # --store memory: one backend, all ranks (and both instances of a pair)
        self._memory: MemoryStore | None = None if self.peer is None else self.peer._memory
        self._pool_ranks = 1                        # clients mounting a segment (TP ranks)
        self._env_before: dict[str, str | None] = {}
        # Where the ranks run in processes of their own (the model worker at TP N,
        # worker/ranks.py): files their waiting rows before a check, and says the
        # ranks run at once.
        self.gather: Any = None
        self.concurrent_ranks = False
        if spec.kind == "mooncake":
            if self.peer is not None:
                address = self.peer.address
            elif spec.host is None:
                self.master = MasterProcess()
                address = self.master.address
            else:
                wait_reachable(spec.host, spec.port)
                address = f"{spec.host}:{spec.port}"
            self.label = f"mooncake://{address}"
        else:
            address = "127.0.0.1:1"      # never contacted
            self.label = "memory"
        self.address = address
        self._segment = spec.capacity_bytes or SEGMENT_BYTES
        config = {"metadata_server": "P2PHANDSHAKE", "master_server_address": address,
                  "protocol": "tcp", "device_name": "", "mode": "embedded",
                  "local_buffer_size": LOCAL_BUFFER_BYTES}
        if spec.capacity_bytes is not None:     # else Mooncake's default, as a server's
            config["global_segment_size"] = spec.capacity_bytes
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

    @property
    def backend(self) -> str:
        """The store's kind, as ``--json`` names it: memory or mooncake."""
        return self.spec.kind

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
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized,
            get_kv_transfer_group,
        )

        init_one_rank_world(vllm_config, self.tmp)
        if not torch.cuda.is_available():
            torch.cuda.Event = NoopCudaEvent  # type: ignore[assignment,misc]
        par = vllm_config.parallel_config
        tp, dcp = par.tensor_parallel_size, par.decode_context_parallel_size
        self._pool_ranks = tp
        log = self.tmp / "mooncake-client.log"
        for rank in range(tp):
            try:
                with self.store_module(), start_up_log(log), \
                        as_rank(vllm_config, rank, tp, dcp):
                    # The process's own connector, unless another engine in this
                    # process holds that (a paused time segment's): then one of
                    # its own, made the process's around each of its steps.
                    if rank == 0 and self.peer is None \
                            and kv_transfer_state._KV_CONNECTOR_AGENT is None:
                        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
                        connector = get_kv_transfer_group()
                    else:
                        connector = create_worker_connector(vllm_config, kv_cache_config)
            except RuntimeError as exc:
                self.keep_tmp = True
                raise StoreError(f"store {self.label}: could not start the Mooncake client "
                                 f"of rank {rank} ({exc}; is the pool of {self._segment} "
                                 f"bytes too small? client log: {log})") from None
            worker = connector.connector_worker
            recorder = RecordingStore(worker.store, self.label, rank=rank,
                                      boundary_of=boundary_of, ops=self.ops)
            worker.store = recorder
            one = WorkerRank(rank, connector, worker, recorder,
                             allocate_kv_caches(kv_cache_config, seed=rank))
            connector.register_kv_caches(one.kv_caches)
            self.ranks.append(one)
            self._wrap_for_fixed_order(one)
            self.name_loaders(one)
        if tp > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self._aggregator = KVOutputAggregator.from_connector(self.ranks[0].connector, tp)

    @contextmanager
    def store_module(self):
        """For ``--store memory``: the worker imports our store as mooncake.store."""
        if self.spec.kind != "memory":
            yield
            return
        saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.store")}
        pkg = types.ModuleType("mooncake")
        mod = types.ModuleType("mooncake.store")
        if self._memory is None:
            # One store stands for the pool every rank's client mounts a segment of.
            cap = self.spec.capacity_bytes
            self._memory = MemoryStore(None if cap is None else cap * self._pool_ranks)
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
    def name_loaders(one: WorkerRank) -> None:
        """Each receive thread tells the recorder whose load it runs, so every get
        is filed under the request that fetched it (``expect_store.gets``)."""
        name_receive_threads(one.worker, one.recorder.loading)

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
        for _, _, _, rank in selectors:
            if rank is None and self.concurrent_ranks and len(self.ranks) > 1:
                raise StoreError(f"store {self.label}: store_fault on {op} names no rank, and "
                                 f"the model worker's {len(self.ranks)} ranks run at once, "
                                 "so which rank meets it first is not fixed; name a rank "
                                 "(keys: [{..., rank: R}]) or replay with --worker null")
            if rank is not None and rank >= len(self.ranks):
                raise StoreError(f"store {self.label}: store_fault on rank {rank}, but the "
                                 f"replay runs {len(self.ranks)} rank(s) "
                                 "(engine.tensor_parallel_size)")
        self.drain_saves()          # faults apply to ops issued from this step on
        with self.ops.lock:
            self.ops.faults.append(Fault(op, tuple(selectors), code, times, step))

    def execute(self, scheduler_output, vllm_config: VllmConfig,
                step: Callable[[Any, Any, VllmConfig], KVConnectorOutput] | None = None,
                ) -> KVConnectorOutput:
        """One engine step of every rank's worker-side connector. ``step(connector,
        scheduler_output, vllm_config)`` runs it as the release's model runner
        does around a forward (the store adapter's ``connector_step``); None:
        0.29-0.33's runner mixin, :func:`mixin_step`."""
        step = step or mixin_step
        if len(self.ranks) == 1 and self.peer is None:
            with _the_process_agent(self.ranks[0].connector):
                return step(self.ranks[0].connector, scheduler_output, vllm_config)
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.v1.outputs import ModelRunnerOutput

        outputs = []
        # The process's connector (a pair's prefill instance's, where this is its
        # decode instance) answers vLLM's worker helpers again after the step.
        process_own = kv_transfer_state._KV_CONNECTOR_AGENT
        try:
            for one in self.ranks:
                own = _worker_copy(scheduler_output)
                kv_transfer_state._KV_CONNECTOR_AGENT = one.connector
                out = step(one.connector, own, vllm_config)
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(out))
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = process_own
        if len(outputs) == 1:
            return outputs[0].kv_connector_output
        return self._aggregator.aggregate(outputs, 0).kv_connector_output

    # -- scheduler side ---------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        conn = scheduler.connector
        sched_side = conn.connector_scheduler
        sched_side.client.close()
        sched_side.client = InProcessLookupClient(self)

    def check(self) -> None:
        if self.gather is not None:
            self.gather()
        if self.ranks:
            failures = self.recorder.take_failures()
            if failures:
                raise StoreError(failures[0] + (f" (and {len(failures) - 1} more)"
                                                 if len(failures) > 1 else ""))

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        # Rank 0's is the process's own where init_worker made it so (not a pair's
        # decode instance's, nor one built beside another engine's).
        for one in self.ranks:
            try:
                if one.connector is kv_transfer_state._KV_CONNECTOR_AGENT:
                    ensure_kv_transfer_shutdown()
                else:
                    one.connector.shutdown()
            except Exception:  # noqa: BLE001 - closing a dead master's client may fail
                pass
        if self.master is not None:
            self.master.close()
        for k, v in self._env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not self.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def mixin_step(connector: Any, scheduler_output: Any,
               vllm_config: VllmConfig) -> KVConnectorOutput:
    """The worker connector's step as 0.29-0.33's model runners run it
    (``KVConnectorModelRunnerMixin._get_kv_connector_output``, the model's
    forward being nothing); it reads the process's agent, ``connector``."""
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    with set_forward_context(None, vllm_config), \
            KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as out:
        pass                                       # the model's forward: nothing
    return out


@contextmanager
def _the_process_agent(connector: Any):
    """``connector`` as the process's own (what vLLM's worker helpers answer)
    for the block: another engine in this process may hold that place."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    before = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = before


def _worker_copy(scheduler_output: Any) -> Any:
    """What one rank's worker gets of the step: each worker process unpickles its
    own scheduler output, so no rank sees another's changes. The parts a worker's
    connector reads (``_get_kv_connector_output``: the connector metadata, the
    finished ids, ``has_sync_kv_loads``) are copied; the rest is shared, as
    copying every new request's tokens for every rank doubled a TP 2 replay."""
    own = copy.copy(scheduler_output)
    own.kv_connector_metadata = copy.deepcopy(scheduler_output.kv_connector_metadata)
    own.finished_req_ids = set(scheduler_output.finished_req_ids)
    return own


def name_receive_threads(worker: Any, loading: Callable[[str | None], None]) -> None:
    """Each of ``worker``'s receive threads calls ``loading(request id)`` around the
    load it runs (``None`` after), so every get is filed under its request: the
    one-rank worker's recorder and each rank's store client alike."""
    for thread in worker.kv_recv_threads:
        handle = thread._handle_request

        def named(req_meta, handle=handle):
            loading(req_meta.req_id)
            try:
                return handle(req_meta)
            finally:
                loading(None)

        thread._handle_request = named
