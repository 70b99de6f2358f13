"""One MooncakeStore worker rank, and what building it inside a replay takes.

:class:`WorkerRank` holds one rank's real connector, its store worker, the
recorder in front of its store client and its KV tensors. The helpers build
it where no GPU worker runs: a real one-rank gloo world for the collective
helpers, the rank helpers the worker reads at construction answering each
rank in turn (:func:`as_rank`, the distribution seam), CPU tensors of
deterministic noise for the KV caches, and a no-op CUDA event. Used by
:mod:`.mooncake_session`; names only what 0.29-0.33 share.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig

from replayer.replay.store.recording import RecordingStore

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"


class NoopCudaEvent:
    """``wait_for_save`` records a CUDA event to fence the forward; a CPU has none."""

    def record(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@dataclass
class WorkerRank:
    """One worker rank: its real connector, the store worker inside it, the
    recorder in front of its store client, and its own KV tensors."""

    rank: int
    connector: Any
    worker: Any
    recorder: RecordingStore
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)


@contextmanager
def start_up_log(path: Path):
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


def allocate_kv_caches(kv_cache_config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
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


def init_one_rank_world(vllm_config: VllmConfig, tmp: Path) -> None:
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
def as_rank(vllm_config: VllmConfig, rank: int, tp: int, dcp: int):
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


def create_worker_connector(vllm_config: VllmConfig, kv_cache_config: Any) -> Any:
    """A further rank's worker-side connector, as ``ensure_kv_transfer_initialized``
    builds rank 0's (without making it the process's one)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.WORKER,
                                               kv_cache_config=kv_cache_config)
