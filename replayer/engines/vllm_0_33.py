"""Adapter for vLLM 0.33.x: builds the real EngineCore over a null executor.

Everything specific to this vLLM release range lives here: config classes,
KV-cache spec classes, the executor interface, and the output dataclasses.

What runs is vLLM's own code: ``VllmConfig`` resolution, ``EngineCore`` (KV
cache planning, ``resolve_kv_cache_block_sizes``, the request block hasher),
the ``Scheduler``, ``KVCacheManager``, coordinator and single-type managers.
The one seam replaced is the model: :class:`NullExecutor` stands where the GPU
workers would, reports the KV-cache layer specs the trace's geometry asks for,
and answers each step with the trace's output tokens. Drafts proposed for
speculative decoding are the request's true next tokens, so every draft is
accepted (the recorded schedule, when a trace has one, is a later addition).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from math import ceil
from pathlib import Path
from typing import Any

import torch

from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from .base import EngineInfo, EngineRequest, PrefillOutcome, StepResult

MODELS = Path(__file__).resolve().parent.parent / "models"
TARGET_MODEL = MODELS / "tiny-llama"
DRAFT_MODEL = MODELS / "tiny-eagle"

VERSIONS = ("0.33",)          # release range this adapter serves
DEFAULT_BLOCK_SIZE = 16       # CacheConfig.DEFAULT_BLOCK_SIZE in 0.33
HEAD_SIZE = 4                 # of the largest-block attention group; others scale (small pages keep KV buffers small)
DTYPE = torch.float16


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class NullExecutor(Executor):
    """The model seam: no workers, no tensors; outputs come from the trace.

    ``collective_rpc`` answers the calls EngineCore makes while it plans the KV
    cache, as a single worker would.
    """

    uses_ray = False
    supports_pp = False
    # Set by the adapter before construction (EngineCore builds the executor).
    layer_specs: dict[str, KVCacheSpec] = {}
    store_session = None    # a mooncake_0_33.StoreSession when the trace has a connector

    def _init_executor(self) -> None:
        self.adapter: "Vllm033Engine | None" = None
        self.kv_cache_configs = None

    def check_health(self) -> None:
        return None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        name = method if isinstance(method, str) else method.__name__
        handler = getattr(self, f"_rpc_{name}", None)
        if handler is None:
            raise NotImplementedError(f"null executor: no worker call {name!r}")
        result = [handler(*args, **(kwargs or {}))]
        return _done(result) if non_block else result

    def _rpc_get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return dict(self.layer_specs)

    def _rpc_get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def _rpc_set_kv_cache_layout(self, *args: Any) -> None:
        return None

    def _rpc_determine_available_memory(self) -> int:
        # Large enough for any override; num_gpu_blocks_override decides.
        return 1 << 40

    def _rpc_initialize_from_config(self, kv_cache_configs: Any) -> None:
        self.kv_cache_configs = kv_cache_configs
        if self.store_session is not None:
            # The worker-side connector, as a GPU worker creates it.
            self.store_session.init_worker(self.vllm_config, kv_cache_configs[0],
                                           NullExecutor.boundary_of)

    def _rpc_get_kv_connector_handshake_metadata(self) -> None:
        return None

    def compile_or_warm_up_model(self) -> None:
        # The base class expects compile-time records from real workers.
        return None

    def execute_model(self, scheduler_output, non_block: bool = False):
        assert self.adapter is not None
        out = self.adapter._model_output(scheduler_output)
        return _done(out) if non_block else out

    def sample_tokens(self, grammar_output):  # pragma: no cover - execute_model never defers
        raise AssertionError("null executor never defers sampling")

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        assert self.adapter is not None
        return self.adapter._drafts()

    def shutdown(self) -> None:
        return None


def _group_block_size(engine: dict[str, Any], group: dict[str, Any]) -> int:
    return int(group.get("block_size", engine.get("block_size", DEFAULT_BLOCK_SIZE)))


def layer_specs(engine: dict[str, Any]) -> dict[str, KVCacheSpec]:
    """One layer per declared group (two where EAGLE adds a draft layer).

    vLLM groups layers with equal specs and needs one page size across groups:
    attention head sizes scale inversely with block size and Mamba pages are
    padded to match, as vLLM's own hybrid models do.
    """
    groups = engine["kv_groups"]
    sizes = [_group_block_size(engine, g) for g in groups]
    largest = max(sizes)
    for g, bs in zip(groups, sizes):
        if g["kind"] != "mamba" and largest % bs:
            raise ValueError(f"attention block size {bs} must divide the largest group "
                             f"block size {largest}")
    page = 2 * largest * HEAD_SIZE * DTYPE.itemsize
    spec_cfg = engine.get("speculative")
    n_spec = int(spec_cfg.get("num_speculative_tokens", 1)) if spec_cfg else 0
    mode = engine.get("mamba_cache_mode", "align")
    specs: dict[str, KVCacheSpec] = {}
    draft_added = False
    for i, (g, bs) in enumerate(zip(groups, sizes)):
        kind = g["kind"]
        head = HEAD_SIZE * largest // bs
        if kind == "mamba":
            spec: KVCacheSpec = MambaSpec(
                block_size=bs, shapes=((4,),), dtypes=(DTYPE,), page_size_padded=page,
                mamba_cache_mode=mode, num_speculative_blocks=n_spec)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=head, dtype=DTYPE,
                                     sliding_window=int(g["sliding_window"]))
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=2 * head, dtype=DTYPE)
        else:
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head, dtype=DTYPE)
        specs[f"model.layers.{i}.{kind}"] = spec
        # The draft model's layers share the first attention group's spec;
        # vLLM marks the group holding them as the EAGLE group.
        if spec_cfg and not draft_added and kind in ("full_attention", "mla"):
            specs["draft.layers.0.attn"] = _as_draft(spec)
            draft_added = True
    # Keep the number of layers per group equal, as vLLM's grouping assumes.
    if draft_added:
        for i, (g, bs) in enumerate(zip(groups, sizes)):
            name = f"model.layers.{i}.{g['kind']}"
            if not any(k.startswith("draft.") and specs[k] == specs[name] for k in specs):
                specs[f"model.layers.{i}.{g['kind']}.twin"] = specs[name]
    return specs


def _as_draft(spec: KVCacheSpec) -> KVCacheSpec:
    from dataclasses import replace

    return replace(spec, is_draft=True)


def build_vllm_config(engine: dict[str, Any], max_model_len: int) -> VllmConfig:
    """The trace's engine block as vLLM's own config objects; vLLM resolves the rest."""
    groups = engine["kv_groups"]
    has_mamba = any(g["kind"] == "mamba" for g in groups)
    attn_sizes = [_group_block_size(engine, g) for g in groups if g["kind"] != "mamba"]
    block_size = int(engine.get("block_size", min(attn_sizes)))
    model = ModelConfig(model=str(TARGET_MODEL), skip_tokenizer_init=True,
                        max_model_len=max_model_len, dtype="float16")
    parallel = ParallelConfig(distributed_executor_backend=NullExecutor)
    cache_kwargs: dict[str, Any] = dict(
        block_size=block_size,
        enable_prefix_caching=engine.get("enable_prefix_caching", True),
        num_gpu_blocks_override=int(engine["num_gpu_blocks"]),
    )
    for key in ("prefix_match_unit", "prefix_caching_hash_algo",
                "enable_mamba_shared_prefix_checkpoint"):
        if key in engine:
            cache_kwargs[key] = engine[key]
    if "prefix_cache_retention_interval" in engine:
        cache_kwargs["prefix_cache_retention_interval"] = engine["prefix_cache_retention_interval"]
    if has_mamba:
        mamba_bs = [_group_block_size(engine, g) for g in groups if g["kind"] == "mamba"]
        cache_kwargs["mamba_cache_mode"] = engine.get("mamba_cache_mode", "align")
        cache_kwargs["mamba_block_size"] = mamba_bs[0]
    cache = CacheConfig(**cache_kwargs)
    sched_kwargs: dict[str, Any] = dict(max_model_len=max_model_len, is_encoder_decoder=False,
                                        async_scheduling=False)
    for key in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                "long_prefill_token_threshold"):
        if key in engine:
            sched_kwargs[key] = engine[key]
    scheduler = SchedulerConfig(**sched_kwargs)
    speculative = None
    spec_cfg = engine.get("speculative")
    if spec_cfg:
        speculative = SpeculativeConfig(
            method=spec_cfg["method"], model=str(DRAFT_MODEL),
            num_speculative_tokens=int(spec_cfg.get("num_speculative_tokens", 1)),
            disable_lookahead_block_hashes=bool(spec_cfg.get("disable_lookahead_block_hashes",
                                                             False)),
            target_model_config=model, target_parallel_config=parallel)
    kv_transfer = None
    if engine.get("connector"):
        from .mooncake_0_33 import kv_transfer_config

        kv_transfer = kv_transfer_config(engine)
    config = VllmConfig(model_config=model, cache_config=cache, parallel_config=parallel,
                        scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"),
                        speculative_config=speculative, kv_transfer_config=kv_transfer)
    # On a platform vLLM does not know (CPU without its kernels) it turns the
    # hybrid KV-cache manager off; production GPUs keep it on.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


class _Timed:
    """Wraps a scheduler method to add up the seconds spent inside vLLM."""

    __slots__ = ("fn", "seconds")

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


class Vllm033Engine:
    """The real EngineCore, driven one step at a time by the replay loop."""

    def __init__(self, engine: dict[str, Any], max_model_len: int, version: str,
                 store=None, record_dir: str | None = None) -> None:
        self.info = EngineInfo(vllm=version)
        NullExecutor.layer_specs = layer_specs(engine)
        self.config = build_vllm_config(engine, max_model_len)
        if record_dir is not None:
            # Record this run through vLLM's own hooks (replayer.recorder).
            from ..recorder.install import install_recorder

            install_recorder(self.config, record_dir)
        self.session = None
        self._boundaries: dict[str, tuple[int, str]] = {}
        self._step = 0
        if engine.get("connector"):
            from ..store import StoreSpec
            from .mooncake_0_33 import StoreSession

            self.session = StoreSession(store or StoreSpec("memory"))
        NullExecutor.store_session = self.session
        NullExecutor.boundary_of = staticmethod(self._boundaries.get)
        try:
            self.core = EngineCore(self.config, NullExecutor, log_stats=True)
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        executor = self.core.model_executor
        assert isinstance(executor, NullExecutor)
        executor.adapter = self
        self.scheduler = self.core.scheduler
        self._hash_block_size = self.scheduler.kv_cache_config.hash_block_size or 1
        if self.session is not None:
            self.session.attach_scheduler(self.scheduler)
        from .explain_0_33 import GroupHits

        self.group_hits = GroupHits(self.scheduler)
        self._schedule = _Timed(self.scheduler.schedule)
        self._update = _Timed(self.scheduler.update_from_output)
        self.scheduler.schedule = self._schedule  # type: ignore[method-assign]
        self.scheduler.update_from_output = self._update  # type: ignore[method-assign]
        self.num_spec = self.config.num_speculative_tokens if self.config.speculative_config else 0
        self._outputs: dict[str, list[int]] = {}  # request id -> output tokens
        self._sampled: list[str] = []
        # (step, request id) -> drafts accepted, from a recorded steps table.
        self._accepted: dict[tuple[int, str], int] | None = None

    # -- the model seam -------------------------------------------------
    def _model_output(self, so) -> ModelRunnerOutput:
        scheduled = so.num_scheduled_tokens
        self._sampled = []
        kv_out = self.session.execute(so, self.config) if self.session is not None else None
        if not scheduled:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_out)
        requests = self.scheduler.requests
        spec = so.scheduled_spec_decode_tokens
        req_ids = list(scheduled)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = requests[rid]
            # Schedule() has advanced num_computed_tokens: a request samples
            # once every known token (prompt and outputs so far) is computed.
            if req.num_computed_tokens >= req.num_tokens:
                n = req.num_output_tokens
                k = 1 + len(spec.get(rid, ()))
                if self._accepted is not None:
                    k = 1 + min(k - 1, self._accepted.get((self._step - 1, rid), k - 1))
                sampled.append(self._outputs[rid][n:n + k])
                self._sampled.append(rid)
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def _drafts(self) -> DraftTokenIds | None:
        if not self.num_spec or not self._sampled:
            return None
        requests = self.scheduler.requests
        ids, drafts = [], []
        for rid in self._sampled:
            req = requests.get(rid)
            if req is None or req.is_finished():
                continue
            n = req.num_output_tokens
            ids.append(rid)
            drafts.append(self._outputs[rid][n:n + self.num_spec])
        return DraftTokenIds(ids, drafts) if ids else None

    # -- the replay loop's interface -------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._outputs[request.id] = request.output_tokens
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0,
                                detokenize=False)
        ecr = EngineCoreRequest(
            request_id=request.id, prompt_token_ids=request.prompt_tokens, mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
            cache_salt=request.cache_salt, data_parallel_rank=None)
        req, wave = self.core.preprocess_add_request(ecr)
        if self.session is not None:
            # Store keys name block hashes; remember which token boundary each
            # ends at, and the first request that had that prefix.
            hbs = self._hash_block_size
            for i, h in enumerate(req.block_hashes):
                self._boundaries.setdefault(bytes(h).hex(), ((i + 1) * hbs, request.id))
        self.core.add_request(req, wave)

    def step(self) -> StepResult:
        if self.session is not None:
            self.session.recorder.step = self._step
        self._step += 1
        outputs, executed = self.core.step()
        self.core.post_step(executed)
        if self.session is not None:
            self.session.check()
        result = StepResult(executed=executed)
        for eco in outputs.values():
            for out in eco.outputs:
                stats = out.prefill_stats
                if stats is not None:
                    result.prefills.append(PrefillOutcome(
                        id=out.request_id, num_prompt_tokens=stats.num_prompt_tokens,
                        num_cached_tokens=stats.num_cached_tokens,
                        num_local_cached_tokens=stats.num_local_cached_tokens,
                        num_external_cached_tokens=stats.num_external_cached_tokens,
                        group_hits=self.group_hits.take(out.request_id)))
                if out.finish_reason is not None:
                    result.finished.append(out.request_id)
                    self._outputs.pop(out.request_id, None)
        return result

    def hold_accepted(self, accepted: dict[tuple[int, str], int]) -> None:
        """Accept only as many drafts per step as the recording did (its steps table)."""
        self._accepted = accepted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_requests()

    def reset_prefix_cache(self) -> bool:
        # The GPU-side cache only: the store keeps its keys, as in production.
        return self.core.reset_prefix_cache(reset_running_requests=False, reset_connector=False)

    def kv_groups(self) -> list[dict[str, Any]]:
        """vLLM's KV-cache groups, in its order: kind and whether the EAGLE drop applies."""
        return self.group_hits.describe()

    def store_report(self) -> dict[str, Any] | None:
        """Store operations recorded so far (None without a connector)."""
        if self.session is None:
            return None
        ops = self.session.recorder.ops
        return {"backend": self.session.spec.kind, "rows": list(ops.rows),
                "lookups": list(ops.lookups), "seconds": self.session.recorder.seconds}

    def abort(self, request_id: str) -> None:
        self.core.abort_requests([request_id])
        self._outputs.pop(request_id, None)

    def vllm_seconds(self) -> float:
        return self._schedule.seconds + self._update.seconds

    def close(self) -> None:
        try:
            self.core.shutdown()
        except Exception:  # noqa: BLE001 - shutdown of a null executor has nothing to lose
            pass
        if self.session is not None:
            self.session.close()


def open_engine(engine: dict[str, Any], max_model_len: int, version: str,
                store=None) -> Vllm033Engine:
    return Vllm033Engine(engine, max_model_len, version, store=store)
