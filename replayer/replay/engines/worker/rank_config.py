"""What a config at TP N tells each rank process of the model worker.

vLLM hands every rank its ``VllmConfig``; the model worker's ranks
(:mod:`.rank_worker`, built by vLLM's ``MultiprocExecutor`` in :mod:`.ranks`)
find there the worker class to build (``parallel_config.worker_cls``) and the
seams to install in their process (``additional_config[SEAMS_KEY]``).
"""

from __future__ import annotations

from typing import Any

# vllm_config.additional_config[SEAMS_KEY]: what each rank process installs.
SEAMS_KEY = "prefix_replayer_rank_seams"
RANK_WORKER = "replayer.replay.engines.worker.rank_worker.RankWorker"


def rank_seams(engine: Any, label: str) -> dict[str, Any]:
    """What every rank process installs (:func:`.rank_worker.install_process_seams`)."""
    kinds = {g.kind for g in engine.kv_groups}
    return {"block_size": engine.block_size, "label": label,
            "interpret_kernels": bool(engine.speculative is not None and engine.has_mamba),
            # KDA beside MLA: the FLA KDA kernels' interpreted copy, made in each rank
            "kda_mla": "mla" in kinds and "mamba" in kinds,
            # DCP beside MLA: vLLM's Triton MLA and its DCP kernels interpreted
            "mla_dcp": "mla" in kinds and engine.decode_context_parallel_size > 1}


def configure_ranks(config: Any, engine: Any, label: str) -> None:
    """A built config at TP N: its ranks build :class:`.rank_worker.RankWorker`,
    which installs :func:`rank_seams`."""
    config.parallel_config.worker_cls = RANK_WORKER
    config.additional_config = {**(config.additional_config or {}),
                                SEAMS_KEY: rank_seams(engine, label)}
