"""vLLM's OffloadingConnector on the model worker: the transfer handler, where vLLM's worker creates it.

On the null executor the replay builds the worker-side ``OffloadingConnector``
itself (:mod:`replayer.replay.engines.connector.offloading_0_33`), over a
handler that moves nothing. On the model worker vLLM does both: the worker's
``initialize_from_config`` creates the connector
(``ensure_kv_transfer_initialized``), its model runner registers the KV
tensors it allocated (``register_kv_caches``: vLLM derives each group's
tensors and page sizes from the real ones, ``CanonicalKVCaches``) and runs
``handle_preemptions``, ``start_load_kv``, ``wait_for_save`` and
``get_finished`` in every step (``KVConnectorModelRunnerMixin``). One part is
replaced: the **transfer handler** ``register_kv_caches`` asks its spec for
(``CPUOffloadingSpec.get_worker``, which refuses any platform but CUDA-alike
GPUs and XPUs: its ``CPUOffloadingWorker`` copies on CUDA streams) is
:class:`HostCopies`, which copies the same bytes vLLM's handler would (each
group's pages between the runner's KV tensors and CPU chunks of
``blocks_per_chunk`` blocks, the first chunk entered at the group's
``block_indices``), with ``Tensor.copy_`` in the submitting call. So a load
writes into the block the model then attends to, or whose state it resumes
from, what the store read out of the block that computed it. Every job is
finished, successfully, by the next ``get_finished``, as on the null executor
(the completion-order seam).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from replayer.replay.engines.connector.offloading_0_33 import FinishedTransfers
from replayer.replay.engines.worker.executor import ModelExecutor


class HostCopies(FinishedTransfers):
    """vLLM's ``OffloadingWorker`` interface over the runner's host KV tensors:
    stores and loads copy pages as ``CPUOffloadingWorker``'s direct layout does,
    then are reported finished (:class:`FinishedTransfers`)."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
        super().__init__()
        import torch

        self.refs = kv_caches.group_data_refs
        self.per_chunk = blocks_per_chunk
        self.blocks: list[Any] = []          # each tensor as (blocks, page bytes), int8
        self.chunks: list[Any] = []          # its CPU tier: (chunks x per_chunk, page bytes)
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self.blocks.append(t.tensor.view(torch.int8).view(-1, page))
            self.chunks.append(torch.zeros(num_chunks * blocks_per_chunk, page,
                                           dtype=torch.int8))

    def _pairs(self, gpu_spec: Any, cpu_spec: Any):
        """(group, GPU block ids, CPU sub-block rows) per group, as vLLM's
        handler pairs them (``SingleDirectionOffloadingHandler.transfer_async``)."""
        import numpy as np

        gpu, cpu = gpu_spec.block_ids, cpu_spec.block_ids
        g_off = c_off = 0
        for group, (size, first) in enumerate(zip(gpu_spec.group_sizes,
                                                  gpu_spec.block_indices)):
            if size == 0:
                continue
            skip = first % self.per_chunk
            n_chunks = -(-(size + skip) // self.per_chunk)
            rows = (cpu[c_off:c_off + n_chunks].astype(np.int64)[:, None] * self.per_chunk
                    + np.arange(self.per_chunk)).ravel()[skip:skip + size]
            yield group, gpu[g_off:g_off + size].astype(np.int64), rows
            g_off, c_off = g_off + size, c_off + n_chunks
        if g_off != len(gpu) or c_off != len(cpu):
            raise RuntimeError(f"offload transfer: {len(gpu)} GPU blocks and {len(cpu)} CPU "
                               f"chunks do not pair by group_sizes {gpu_spec.group_sizes}")

    def _copy(self, gpu_spec: Any, cpu_spec: Any, to_cpu: bool) -> None:
        import torch

        for group, blocks, rows in self._pairs(gpu_spec, cpu_spec):
            b, r = torch.from_numpy(blocks), torch.from_numpy(rows)
            for ref in self.refs[group]:
                n = ref.page_size_bytes
                gpu, cpu = self.blocks[ref.tensor_idx], self.chunks[ref.tensor_idx]
                if to_cpu:
                    cpu[r, :n] = gpu[b, :n]
                else:
                    gpu[b, :n] = cpu[r, :n]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._copy(src_spec, dst_spec, to_cpu=True)
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        self._copy(dst_spec, src_spec, to_cpu=False)
        return super().submit_load(job_id, src_spec, dst_spec, expedited)


@contextmanager
def host_copies():
    """While vLLM's worker builds its connector and registers the KV tensors:
    the CPU spec's ``get_worker`` answers :class:`HostCopies`."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    real = CPUOffloadingSpec.get_worker
    CPUOffloadingSpec.get_worker = lambda self, kv_caches: HostCopies(
        kv_caches, self.blocks_per_chunk, self.num_chunks)
    try:
        yield
    finally:
        CPUOffloadingSpec.get_worker = real


class OffloadModelExecutor(ModelExecutor):
    """The model worker's executor, plus the transfer handler of the
    ``OffloadingConnector`` vLLM's worker creates (:class:`HostCopies`)."""

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        with host_copies():
            super().initialize_from_config(kv_cache_configs)
        connector = get_kv_transfer_group()
        if not isinstance(connector.connector_worker.worker, HostCopies):
            raise RuntimeError("model worker: vLLM's OffloadingConnector did not take the "
                               "replay's transfer handler (register_kv_caches not run)")
        self.adapter.session.adopt_worker(connector, self.adapter.boundaries.get)
