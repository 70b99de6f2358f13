"""The model worker at TP N: vLLM's own multiprocess executor, one process per rank.

:class:`RankExecutor` is vLLM's ``MultiprocExecutor`` as a CPU server runs it
at ``--tensor-parallel-size N``: N worker processes (spawned, as vLLM's CPU
platform requires), a gloo world between them with vLLM's CPU communicator,
the scheduler's output broadcast to every rank over vLLM's shared-memory
message queue, each rank's output merged by vLLM's ``KVOutputAggregator``.
Each rank is :class:`.rank_worker.RankWorker` (vLLM's ``CPUWorker`` with the
replay's seams installed in its process; that module says how each reaches
the ranks). What this executor adds in the replay's process, and nothing else:

* each step's forced-token facts ride with the step to every rank
  (``replayer_execute_model``); the drafts are the trace's, chosen here as on
  one rank (:meth:`take_draft_token_ids`);
* a refusal of a KV cache that does not fit in this machine's memory, over
  all ranks' caches;
* OpenMP threads not bound to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``,
  unless set): vLLM's automatic binding reserves cores a 2-core machine does
  not have; the ranks share the cores;
* with a connector (:class:`StoreRankExecutor`): the replay's one store
  served to every rank process (:mod:`.store_proxy`), the scheduler's lookup
  sent to rank 0's connector, and store faults that name no rank refused (the
  ranks run at once, so which one meets such a fault first is not fixed).

:func:`executor_class` picks the model worker's executor for a trace.
"""

from __future__ import annotations

import os
from typing import Any

import vllm.envs as envs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import DraftTokenIds

from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.engines.core_driver import _BUILDING
from replayer.replay.engines.worker.executor import refuse_oversized_cache
from replayer.replay.engines.worker.forced import forced_for

def executor_class(engine: Any) -> type:
    """The model worker's executor for ``engine``: one rank in process (vLLM's
    ``UniProcExecutor``) at TP 1, vLLM's ``MultiprocExecutor`` above; with the
    store's seams where the trace has a connector."""
    if engine.tensor_parallel_size > 1:
        return StoreRankExecutor if engine.connector else RankExecutor
    if engine.connector == "offloading":
        from replayer.replay.engines.worker.offload import OffloadModelExecutor

        return OffloadModelExecutor
    if engine.connector:
        from replayer.replay.engines.worker.store import StoreModelExecutor

        return StoreModelExecutor
    from replayer.replay.engines.worker.executor import ModelExecutor

    return ModelExecutor


class RankExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor with the replay's seams (module docstring)."""

    computes_logprobs = True

    def _init_executor(self) -> None:
        self.adapter = _BUILDING.get()
        # The draft seam runs here; the sampled tokens are forced in each rank.
        self.forced = forced_for(self.adapter, self.vllm_config)
        self._sent: set[str] = set()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self._before_ranks_start()
        super()._init_executor()

    def _before_ranks_start(self) -> None:
        """What the rank processes must find ready when they start (the store)."""

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        refuse_oversized_cache(self.vllm_config, kv_cache_configs)
        super().initialize_from_config(kv_cache_configs)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        requests = self.adapter.scheduler.requests
        outputs = {rid: self.adapter._outputs[rid] for rid in scheduler_output.num_scheduled_tokens
                   if rid not in self._sent and rid in self.adapter._outputs}
        self._sent.update(outputs)
        committed = {rid: requests[rid].num_output_tokens
                     for rid in scheduler_output.num_scheduled_tokens}
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if drafts:               # a verification step (what the rank's seam counts)
                self.forced.verified[rid] = self.forced.verified.get(rid, 0) + 1
        return self.collective_rpc(
            "replayer_execute_model", args=(scheduler_output, outputs, committed),
            unique_reply_rank=self.output_rank, non_block=non_block,
            timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
            kv_output_aggregator=self.kv_output_aggregator,
            ec_output_aggregator=self.ec_output_aggregator)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        # The drafter ran for real on every rank; rank 0's proposals are taken (and
        # dropped), then the trace's drafts go to the scheduler (.forced).
        real = super().take_draft_token_ids()
        if real is None:
            return None
        live = self.adapter.scheduler.requests
        ids = [rid for rid in real.req_ids if rid in live]
        if not ids:
            return None
        num_spec = self.vllm_config.speculative_config.num_speculative_tokens
        return DraftTokenIds(ids, self.forced.drafts(ids, num_spec))

    def rank_memory(self) -> list[dict[str, int]]:
        """Each rank process's resident memory now."""
        return self.collective_rpc("replayer_rank_memory")


class _RemoteConnector:
    """Stands for a rank's connector in the replay's process: it lives in the rank's."""

    def shutdown(self) -> None:
        return None


class _RemoteWorker:
    """What the store session reads of a rank's store worker, in the replay's
    process: its store (the rank's recorder), its send thread (None: every save
    was drained in the rank before the step ended) and, for rank 0, the lookup."""

    kv_send_thread = None

    def __init__(self, executor: "StoreRankExecutor", recorder: Any) -> None:
        self.executor = executor
        self.store = recorder

    def lookup(self, num_tokens: int, block_hashes: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
            decode_lookup_response,
        )

        blob = b"".join(bytes(h) for h in block_hashes)
        hash_len = len(bytes(block_hashes[0])) if len(block_hashes) else 0
        payload = self.executor.collective_rpc(
            "replayer_lookup", args=(num_tokens, blob, hash_len), unique_reply_rank=0)
        self.executor.server.flush()
        return decode_lookup_response(payload)


class StoreRankExecutor(RankExecutor):
    """:class:`RankExecutor` with the replay's store served to every rank."""

    def _before_ranks_start(self) -> None:
        import sys

        from replayer.replay.engines.connector.mooncake_ranks import WorkerRank
        from replayer.replay.engines.worker.rank_config import SEAMS_KEY
        from replayer.replay.engines.worker.store_proxy import StoreServer

        session = self.adapter.session
        tp = self.parallel_config.tensor_parallel_size
        if session.spec.kind != "memory":
            raise UnsupportedByEngine(
                f"store {session.label} at tensor_parallel_size {tp} on the model worker: "
                "each rank's Mooncake client would read buffers registered in the rank's "
                "own process, and the replay's store lives in its process; replay it with "
                "--store memory (or --worker null)")
        session._pool_ranks = tp
        with session.store_module():
            backend = sys.modules["mooncake.store"].MooncakeDistributedStore()
        self.server = StoreServer(backend, session.label, tp, self.adapter.boundaries.get,
                                  session.ops, str(session.tmp))
        session.gather = self.server.flush
        session.concurrent_ranks = True
        for rank, rec in enumerate(self.server.recorders):
            session.ranks.append(WorkerRank(rank, _RemoteConnector(),
                                            _RemoteWorker(self, rec), rec))
        self.vllm_config.additional_config[SEAMS_KEY]["store"] = self.server.client_info()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            server = getattr(self, "server", None)
            if server is not None:
                server.close()
