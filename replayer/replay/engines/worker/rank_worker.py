"""One tensor-parallel rank of the model worker, in its own process, with the replay's seams.

At TP N the model worker runs vLLM's ``MultiprocExecutor`` (:mod:`.ranks`):
one process per rank, started by vLLM itself (spawned: vLLM's CPU platform
forces ``spawn``), each building the worker class the config names
(``parallel_config.worker_cls``). :class:`RankWorker` is that class: vLLM's
``CPUWorker``, unchanged, which first installs in its own process the seams
the one-rank model worker gets from its executor. This is how each seam
reaches every rank:

* **weights**: the seeded loader is registered here (:func:`.weights.register`)
  before the model loads, so the config's ``load_format`` names it in this
  process too; every rank draws the same values (a pure function of each
  parameter's name), then vLLM shards them;
* **attention at blocks not a multiple of 32** (:func:`.attention.select`) and
  **vLLM's Mamba-copy kernels under Triton's interpreter** (:mod:`.kernels`;
  ``TRITON_INTERPRET`` comes with the environment the spawned process copies):
  installed from :data:`SEAMS_KEY` in ``vllm_config.additional_config``, which
  vLLM hands every rank with its config;
* **KDA beside MLA** (Kimi-K3's shape): the FLA KDA kernels' interpreted copy,
  the config class and the draft-verification guard
  (:func:`.architectures.kimi_linear.install`), made in this process as the
  one-rank worker's executor makes them in the replay's;
* **DCP beside MLA**: vLLM's Triton MLA selected for MLA layers and the
  Triton kernels a DCP step runs interpreted (:mod:`.architectures.mla_dcp`);
* **forced tokens**: a :class:`~.forced.ForcedTokens` on this rank's runner.
  Every rank samples, and each keeps its sampled tokens for its next step, so
  each is forced to the trace's. The parent sends, with every step
  (:meth:`RankWorker.replayer_execute_model`), the trace's output tokens of
  requests this rank has not seen and each scheduled request's committed
  output count, read from the scheduler as the one-rank seam reads it;
* **store client** (a connector trace): while vLLM's worker creates this
  rank's connector, ``mooncake.store`` is :mod:`.store_proxy`'s client, which
  forwards each call to the replay's store and recorder in the parent; and
  this rank's loads and saves finish in the step that issued them
  (:class:`.store.StepOrder`).
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from replayer.replay.engines.worker.rank_config import SEAMS_KEY


def install_process_seams(seams: dict[str, Any]) -> None:
    """The seams a process needs before vLLM builds its runner (module docstring)."""
    from replayer.replay.engines.worker import attention
    from replayer.replay.engines.worker.weights import register

    register()
    attention.select(int(seams["block_size"]))
    if seams.get("interpret_kernels"):
        from replayer.replay.engines.worker.kernels import interpret_kernels, pack_index_args

        interpret_kernels(seams["label"])
        pack_index_args()
    if seams.get("kda_mla"):
        from replayer.replay.engines.worker.architectures import kimi_linear

        kimi_linear.install(seams["label"])    # AMX, the config class, KDA interpreted
    if seams.get("mla_dcp"):
        from replayer.replay.engines.worker.architectures import mla_dcp

        mla_dcp.install(seams["label"])        # Triton MLA and the DCP kernels interpreted


class RankWorker(CPUWorker):
    """vLLM's CPU worker for one rank, with the replay's seams (module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.seams = dict(vllm_config.additional_config[SEAMS_KEY])
        install_process_seams(self.seams)
        super().__init__(vllm_config, *args, **kwargs)
        self.trace_outputs: dict[str, list[int]] = {}
        self.committed: dict[str, int] = {}
        self.store_client: Any = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        from replayer.replay.engines.worker.forced import ForcedTokens

        super().load_model(*args, **kwargs)
        vocab = self.vllm_config.model_config.get_vocab_size()
        ForcedTokens(self.trace_outputs, self._committed, vocab).install(self.model_runner)

    def _committed(self, rid: str) -> int:
        return self.committed[rid]

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        store = self.seams.get("store")
        if store is None:
            return super().initialize_from_config(kv_cache_config)
        import torch

        from replayer.replay.engines.connector.mooncake_ranks import NoopCudaEvent
        from replayer.replay.engines.worker.store_proxy import ProxyStore, proxy_module

        if not torch.cuda.is_available():
            torch.cuda.Event = NoopCudaEvent  # type: ignore[assignment,misc]
        saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.store")}
        made: list[ProxyStore] = []
        pkg, mod = proxy_module(store, self.rank, made)
        sys.modules["mooncake"], sys.modules["mooncake.store"] = pkg, mod
        try:
            super().initialize_from_config(kv_cache_config)
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
        self._adopt_connector(made)

    def _adopt_connector(self, made: list[Any]) -> None:
        """This rank's connector finishes its transfers in the step that issued
        them, and names whose load each get runs, as the one-rank worker's does."""
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        from replayer.replay.engines.connector.mooncake_ranks import WorkerRank
        from replayer.replay.engines.connector.mooncake_session import name_receive_threads
        from replayer.replay.engines.worker.store import StepOrder

        if len(made) != 1:
            raise RuntimeError(f"rank {self.rank}: the connector made {len(made)} store "
                               "clients, not one")
        connector = get_kv_transfer_group()
        worker = connector.connector_worker
        self.store_client = made[0]
        StepOrder(WorkerRank(self.rank, connector, worker, made[0]), self.model_runner).install()
        name_receive_threads(worker, made[0].loading)

    # -- what the parent's executor (.ranks) calls besides vLLM's own ----------
    def replayer_execute_model(self, scheduler_output: Any, outputs: dict[str, list[int]],
                               committed: dict[str, int]) -> Any:
        """vLLM's ``execute_model``, after taking the step's forced-token facts."""
        self.trace_outputs.update(outputs)
        self.committed = committed
        return self.execute_model(scheduler_output)

    def replayer_lookup(self, num_tokens: int, blob: bytes, hash_len: int) -> bytes | None:
        """Rank 0's connector answers the scheduler's lookup (vLLM's lookup server
        runs on rank 0 too); the wire encoding is vLLM's own."""
        if self.rank != 0:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            BlobBlockHashes,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
            encode_lookup_response,
        )
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker
        return encode_lookup_response(
            worker.lookup(num_tokens, BlobBlockHashes(memoryview(blob), hash_len)))

    def replayer_rank_memory(self) -> dict[str, int]:
        """This rank process's resident memory, for the docs' per-rank figures."""
        import os

        import psutil

        return {"rank": self.rank, "pid": os.getpid(),
                "rss": int(psutil.Process().memory_info().rss)}
