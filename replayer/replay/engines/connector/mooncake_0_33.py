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
builds its config and specs. The session it holds lives in
:mod:`.mooncake_session`, one worker rank's parts in :mod:`.mooncake_ranks`.

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

from dataclasses import replace
from typing import Any, Callable

from vllm.config import KVTransferConfig

from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.engines.core_driver import CoreEngine, NullExecutor
from replayer.replay.engines.connector.mooncake_session import StoreSession
from replayer.replay.schedule import KeySelector
from replayer.replay.store import StoreSpec
from replayer.replay.store.recording import pressure_note
from traces.model.engine_spec import EngineBlock
from traces.model.store_codes import code_name

CONNECTOR_NAMES = {"mooncake_store": "MooncakeStoreConnector"}


def kv_transfer_config(engine: EngineBlock) -> KVTransferConfig:
    """vLLM's ``KVTransferConfig`` for the trace's connector: ``connector_config``'s
    ``kv_role`` is the config's own field (default ``kv_both``), the rest its
    ``kv_connector_extra_config``. What each role does is the connector's own
    code in every release 0.29-0.33 (read in their sources): ``kv_consumer``
    saves no prompt KV (``skip_save``, no Mamba boundary puts, from 0.30 no
    finish-time tail puts, no send thread unless ``save_decode_cache``), and looks up and
    loads; ``kv_producer`` saves, and looks up and loads as ``kv_both`` does
    (``enable_lookup: false`` is vLLM's switch for an instance that never loads)."""
    if engine.connector == "offloading":      # vLLM's CPU offload (0.32-0.34)
        from replayer.replay.engines.connector.offloading_0_33 import kv_transfer_config as cpu

        return cpu(engine)
    extra = dict(engine.connector_config)
    role = extra.pop("kv_role", "kv_both")
    policy = {} if engine.kv_load_failure_policy is None else {
        "kv_load_failure_policy": engine.kv_load_failure_policy}
    return KVTransferConfig(kv_connector=CONNECTOR_NAMES[engine.connector],
                            kv_role=role, kv_connector_extra_config=extra, **policy)


# Releases whose model runner steps the worker-side connector through
# KVConnectorModelRunnerMixin (0.29-0.33); 0.34 removed that runner (V1) and its
# mixin, and its V2 runner steps the connector through ActiveKVConnector.
RUNNER_MIXIN_RELEASES = ("0.29", "0.30", "0.31", "0.32", "0.33")


def connector_step(version: str) -> Callable[[Any, Any, Any], Any] | None:
    """How release ``version``'s model runner steps a worker connector around a
    forward: None for the runner mixin, each session's own default
    (:meth:`.StoreSession.execute`, :meth:`.OffloadSession.execute`)."""
    from replayer.replay.engines import release_prefix

    return None if release_prefix(version, RUNNER_MIXIN_RELEASES) else runner_step


def runner_step(connector: Any, scheduler_output: Any, vllm_config: Any) -> Any:
    """The step as 0.34's model runner takes it on a step without a forward, as
    here (``ActiveKVConnector.no_forward``, ``v1/worker/gpu/kv_connector.py``:
    bind the metadata, ``start_load_kv``, ``finish_forward``, ``wait_for_save``,
    the transfer results). Built without its ``__init__``, which would register
    the KV caches a second time (the session registered them); what it sets
    is set here. MooncakeStore's ``start_load_kv`` reads none of the keyword
    arguments a forward would add."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    runner = ActiveKVConnector.__new__(ActiveKVConnector)
    runner.vllm_config, runner.kv_connector = vllm_config, connector
    runner._pending_load_kwargs, runner._disabled = None, False
    return runner.no_forward(scheduler_output).kv_connector_output


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


def with_segment(spec: StoreSpec, engine: EngineBlock) -> StoreSpec:
    """The store as this trace replays it: ``--store-capacity`` first, else the
    engine block's ``mooncake_global_segment_size`` (each rank's segment).

    A trace that sizes its store is about store pressure, and only the memory
    store replays that: it evicts its oldest objects, deterministically. A real
    master here never evicts (Mooncake evicts on wall-clock leases), so the
    same trace would fill it instead; refused there, in one line."""
    segment = engine.mooncake_global_segment_size
    if segment is None or spec.capacity_bytes is not None:
        return spec
    if spec.kind != "memory":
        raise UnsupportedByEngine(
            f"engine.mooncake_global_segment_size ({segment} bytes): store pressure is "
            f"replayed on the memory store (oldest objects evicted first), not on "
            f"{spec.label()}, whose evictions run on wall-clock leases; give "
            "--store-capacity to replay on it with a pool that never evicts")
    return replace(spec, capacity_bytes=segment)


class StoreConnectorEngine(CoreEngine):
    """The shared driver, plus the MooncakeStore connector when the trace has one.

    ``config`` must name ``executor_cls`` as its executor backend:
    :class:`StoreAwareExecutor`, or on the model worker
    :class:`replayer.replay.engines.worker.store.StoreModelExecutor` (vLLM's own worker
    creates and steps the connector there)."""

    def __init__(self, config: Any, layer_specs: dict[str, Any], version: str,
                 engine: EngineBlock, store: StoreSpec | None = None,
                 executor_cls: type[NullExecutor] = StoreAwareExecutor) -> None:
        self.session: StoreSession | None = None
        self._connector_step = connector_step(version)
        # Block hash (hex) -> (token boundary, first request): names store keys.
        self.boundaries: dict[str, tuple[int, str]] = {}
        # Request id -> how many of its block hashes are in ``boundaries``.
        self._named: dict[str, int] = {}
        # A time segment's (start_name_log): every filing in order, kept or not,
        # so the head names each key as the exact path did (segments/rows.py).
        self.name_log: list[tuple[str, int, str]] | None = None
        if engine.connector == "offloading":      # vLLM's CPU offload: its own session
            from replayer.replay.engines.connector.offloading_0_33 import OffloadSession

            self.session = OffloadSession(engine, store, version)
        elif engine.connector:
            self.session = StoreSession(with_segment(store or StoreSpec("memory"), engine))
        # The pool the trace sized (the model worker reads it in the null executor's bytes).
        self.trace_segment = engine.mooncake_global_segment_size
        try:
            super().__init__(config, layer_specs, version, executor_cls=executor_cls)
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
        return self.session.execute(scheduler_output, self.config, self._connector_step)

    def _on_preprocessed(self, req, request) -> None:
        if self.session is not None:
            # Store keys name block hashes; remember which token boundary each
            # ends at, and the first request that had that prefix.
            self._name_hashes(request.id, req.block_hashes)

    def _name_hashes(self, request_id: str, block_hashes) -> None:
        """File each block hash not yet named under its token boundary and request."""
        hbs = self._hash_block_size
        start = self._named.get(request_id, 0)
        log = self.name_log
        for i in range(start, len(block_hashes)):
            h, site = bytes(block_hashes[i]).hex(), ((i + 1) * hbs, request_id)
            self.boundaries.setdefault(h, site)
            if log is not None:
                log.append((h, *site))
        self._named[request_id] = len(block_hashes)

    def start_name_log(self) -> None:
        """A time segment's replay (:meth:`CoreEngine.start_name_log`): store rows
        too, each marked with how many filings preceded it."""
        super().start_name_log()
        if self.session is None or self.name_log is not None:
            return
        log = self.name_log = []
        self.session.ops.mark = log.__len__

    def segment_marks(self) -> dict[str, int]:
        marks = super().segment_marks()
        if self.session is not None and self.name_log is not None:
            ops = self.session.ops
            marks.update(rows=len(ops.rows), lookups=len(ops.lookups),
                         names=len(self.name_log), gets_checked=ops.gets_checked,
                         gets_corrupted=ops.gets_corrupted, faults=len(ops.faults))
        return marks

    def segment_logs(self) -> dict[str, Any]:
        logs = super().segment_logs()
        if self.name_log is not None:
            logs["store_names"] = self.name_log
        return logs

    def _name_decode_hashes(self) -> None:
        """Blocks a running request fills while it decodes get their hashes from
        vLLM itself (``Request.block_hashes`` grows as output tokens are
        appended), after preprocess: file them before the step whose puts
        write them, so a decode put names its request and boundary too."""
        for req in self.scheduler.running:
            if len(req.block_hashes) > self._named.get(req.request_id, 0):
                self._name_hashes(req.request_id, req.block_hashes)

    def _before_step(self) -> None:
        if self.session is not None:
            self._name_decode_hashes()
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
        notes: list[str] = []
        for f in ops.faults:
            faults.append({"op": f.op, "code": f.code, "times": f.times, "fired": f.fired,
                           "step": f.step})
            if f.fired < f.times:
                what = ", ".join(f"{r}" + ("" if g is None else f" group {g}")
                                 + ("" if b is None else f" @ {b}")
                                 + ("" if k is None else f" rank {k}")
                                 for r, g, b, k in f.selectors)
                notes.append(f"store_fault {f.op} ({what}) armed before step {f.step} "
                             f"fired {f.fired} of {f.times} time(s): no matching "
                             f"{f.op} happened after it ({code_name(f.code)} unused)")
        if ops.pressure is not None:
            notes.append(pressure_note(self.session.label, self.session.spec.kind,
                                       ops.pressure, ops.pressure_puts))
        self.notes.extend(notes)
        return {"backend": self.session.backend, "rows": list(ops.rows),
                "lookups": list(ops.lookups), "faults": faults,
                "gets_checked": ops.gets_checked, "gets_corrupted": ops.gets_corrupted,
                "label": self.session.label, "notes": notes,
                "seconds": sum(r.recorder.seconds for r in self.session.ranks)}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.session is not None:
                self.session.close()
