"""Adapter for vLLM 0.33.x: builds the real EngineCore over a null executor.

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
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)

from traces.engine_spec import EngineBlock

from .core_driver import CoreEngine, LayerPlan, NullExecutor, build_config, plan_layers
from .prefix_hashes import PrefixHashCache


VERSIONS = ("0.33",)          # release range this adapter serves
DTYPE = torch.float16


class StoreAwareExecutor(NullExecutor):
    """The null executor, plus the worker-side MooncakeStore connector when the
    trace has one (created where a GPU worker creates it: on KV-cache init)."""

    adapter: "Vllm033Engine"

    def _rpc_initialize_from_config(self, kv_cache_configs: Any) -> None:
        super()._rpc_initialize_from_config(kv_cache_configs)
        session = self.adapter.session
        if session is not None:
            session.init_worker(self.vllm_config, kv_cache_configs[0],
                                self.adapter.boundaries.get)


def kv_spec(plan: LayerPlan, engine: EngineBlock) -> KVCacheSpec:
    """A layer's spec with 0.33's constructors; draft layers carry ``is_draft``."""
    if plan.kind == "mamba":
        spec: KVCacheSpec = MambaSpec(
            block_size=plan.block_size, shapes=((4,),), dtypes=(DTYPE,),
            page_size_padded=plan.page_bytes, mamba_cache_mode=engine.mamba_cache_mode,
            num_speculative_blocks=engine.num_speculative_tokens)
    elif plan.kind == "sliding_window":
        spec = SlidingWindowSpec(block_size=plan.block_size, num_kv_heads=1,
                                 head_size=plan.head_size, dtype=DTYPE,
                                 sliding_window=int(plan.sliding_window or 0))
    elif plan.kind == "mla":
        spec = MLAAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                head_size=2 * plan.head_size, dtype=DTYPE)
    else:
        spec = FullAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                 head_size=plan.head_size, dtype=DTYPE)
    # vLLM marks the group holding the draft model's layers as the EAGLE group.
    return replace(spec, is_draft=True) if plan.draft else spec


def layer_specs(engine: EngineBlock) -> dict[str, KVCacheSpec]:
    return {p.name: kv_spec(p, engine) for p in plan_layers(engine, DTYPE.itemsize)}


def build_vllm_config(engine: EngineBlock) -> VllmConfig:
    """The shared config, plus 0.33's lookahead-hash flag and the store connector."""
    kv_transfer = None
    if engine.connector:
        from .mooncake_0_33 import kv_transfer_config

        kv_transfer = kv_transfer_config(engine)
    spec = engine.speculative
    lookahead = None if spec is None else {
        "disable_lookahead_block_hashes": spec.disable_lookahead_block_hashes}
    return build_config(engine, StoreAwareExecutor, speculative_args=lookahead,
                        kv_transfer=kv_transfer)


class Vllm033Engine(CoreEngine):
    """The shared driver, plus the store connector and per-group hits of 0.33."""

    def __init__(self, engine: EngineBlock, version: str, store=None,
                 record_dir: str | None = None) -> None:
        config = build_vllm_config(engine)
        if record_dir is not None:
            # Record this run through vLLM's own hooks (replayer.recorder).
            from ..recorder.install import install_recorder

            install_recorder(config, record_dir)
        self.session = None
        # Block hash (hex) -> (token boundary, first request): names store keys.
        self.boundaries: dict[str, tuple[int, str]] = {}
        if engine.connector:
            from ..store import StoreSpec
            from .mooncake_0_33 import StoreSession

            self.session = StoreSession(store or StoreSpec("memory"))
        try:
            super().__init__(config, layer_specs(engine), version,
                             executor_cls=StoreAwareExecutor)
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        self._hash_block_size = self.scheduler.kv_cache_config.hash_block_size or 1
        if self.core.request_block_hasher is not None:
            # Hashes of repeated trace-block chains, bounded by 4x the KV cache's tokens.
            kv_tokens = self.scheduler.kv_cache_config.num_blocks * config.cache_config.block_size
            self.prefix_hashes = PrefixHashCache(
                self.core.request_block_hasher, self._hash_block_size,
                config.num_hash_lookahead_tokens, 4 * kv_tokens // self._hash_block_size)
            self.core.request_block_hasher = self.prefix_hashes
        if self.session is not None:
            self.session.attach_scheduler(self.scheduler)
        from .explain_0_33 import GroupHits

        self.group_hits = GroupHits(self.scheduler, step=lambda: self._step)

    # -- hooks into the shared driver ------------------------------------
    def _kv_output(self, scheduler_output):
        if self.session is None:
            return None
        return self.session.execute(scheduler_output, self.config)

    def _on_preprocessed(self, req, request) -> None:
        if self.session is not None:
            # Store keys name block hashes; remember which token boundary each
            # ends at, and the first request that had that prefix.
            hbs = self._hash_block_size
            for i, h in enumerate(req.block_hashes):
                self.boundaries.setdefault(bytes(h).hex(), ((i + 1) * hbs, request.id))

    def _before_step(self) -> None:
        if self.session is not None:
            self.session.recorder.step = self._step

    def _after_step(self) -> None:
        if self.session is not None:
            self.session.check()

    def _group_hits(self, request_id: str) -> tuple[int, ...] | None:
        return self.group_hits.take(request_id)

    # -- what only this adapter can tell ---------------------------------
    def reset_prefix_cache(self) -> bool:
        # The GPU-side cache only: the store keeps its keys, as in production.
        return super().reset_prefix_cache()

    def kv_groups(self) -> list[dict[str, Any]]:
        """vLLM's KV-cache groups, in its order: kind and whether the EAGLE drop applies."""
        return self.group_hits.describe()

    def lookups(self) -> dict[str, tuple[int, int]]:
        """Each request's last prefix lookup: (engine step, lookup number)."""
        return dict(self.group_hits.lookups)

    def hit_alignment(self) -> int:
        """vLLM's own granularity of prefix hits (``cache_hit_alignment_tokens``)."""
        cfg = self.scheduler.kv_cache_config
        return int(cfg.cache_hit_alignment_tokens or cfg.hash_block_size or 1)

    def store_report(self) -> dict[str, Any] | None:
        """Store operations recorded so far (None without a connector)."""
        if self.session is None:
            return None
        ops = self.session.recorder.ops
        return {"backend": self.session.spec.kind, "rows": list(ops.rows),
                "lookups": list(ops.lookups), "seconds": self.session.recorder.seconds}

    def close(self) -> None:
        super().close()
        if self.session is not None:
            self.session.close()


def open_engine(engine: EngineBlock, version: str, store=None,
                record_dir: str | None = None) -> Vllm033Engine:
    return Vllm033Engine(engine, version, store=store, record_dir=record_dir)
