"""vLLM's config objects from a trace's engine block, and the layers the null model reports.

What every release range shares of building an engine: the tiny model
directories vLLM reads (no hub), ``CacheConfig``/``SchedulerConfig`` arguments
by vLLM's names, one ``VllmConfig`` (TP/DCP as the scheduler sees them), and
the plan of KV-cache layers (one per declared group, the EAGLE draft layer and
its twins) that an adapter turns into its release's spec classes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)

from replayer import MODELS_DIR
from traces.model.engine_spec import RETAIN_DENSE, EngineBlock

if TYPE_CHECKING:
    from replayer.replay.engines.core_driver import NullExecutor

# The tiny model config directories vLLM reads (no hub): the target, its EAGLE
# draft, and an MTP draft (MiMo's architecture, which vLLM turns into mimo_mtp).
MODELS = MODELS_DIR
TARGET_MODEL = MODELS / "tiny-llama"
# The same model with 8 attention and 8 KV heads, for TP above 2 (vLLM needs the
# heads to divide over the ranks; tiny-llama has 2, and 1 KV head). Its KV heads
# split over the ranks, so each rank writes its own attention keys, as a large
# model's do at TP 8. TP 1 and 2 keep tiny-llama, whose name every key carries.
WIDE_TARGET_MODEL = MODELS / "tiny-llama-tp8"
# Kimi-K3's shape (engine.model: kimi-k3): its layer pattern and MLA/KDA
# dimensions, no weights; the Kimi derivation (replayer/shapes) reads it too.
KIMI_K3_MODEL = MODELS / "kimi-k3"
DRAFT_MODEL = MODELS / "tiny-eagle"
MTP_DRAFT_MODEL = MODELS / "tiny-mtp"
# A DFlash draft (Qwen3 architecture, vLLM's DFlashDraftModel) reading the
# target's layer 0 hidden states (dflash_config.target_layer_ids).
DFLASH_DRAFT_MODEL = MODELS / "tiny-dflash"
# A DSpark draft (vLLM's Qwen3DSparkModel: the DFlash Qwen3 backbone plus a
# Markov head), block of 8 as in Kimi-K3's recipe. vLLM 0.33 checks a Qwen3
# DSpark draft against its target only when that target is Qwen3-Omni
# (config/speculative.py _validate_qwen3_omni_dspark), so the tiny Llama
# target serves, as it does for DFlash.
DSPARK_DRAFT_MODEL = MODELS / "tiny-dspark"


def draft_model(method: str, wide: bool = False) -> Path:
    """The draft config vLLM reads for ``method`` (it detects MTP from the config);
    ``wide``: its 8-head twin, beside :data:`WIDE_TARGET_MODEL`."""
    path = {"mtp": MTP_DRAFT_MODEL, "dflash": DFLASH_DRAFT_MODEL,
            "dspark": DSPARK_DRAFT_MODEL}.get(method, DRAFT_MODEL)
    return path.with_name(path.name + "-tp8") if wide else path


def set_mtp_modules(modules: int, hf_config: Any) -> Any:
    """Target ``hf_overrides`` vLLM composes onto the draft's config: the MTP
    draft's module count (``num_nextn_predict_layers``), which decides
    multi-module MTP. Module-level for pickling, as vLLM asks."""
    if getattr(hf_config, "model_type", None) == "mimo_mtp":
        hf_config.update({"num_nextn_predict_layers": modules, "n_predict": modules})
    return hf_config

HEAD_SIZE = 4                 # of the largest-block attention group; others scale


@dataclass(frozen=True)
class LayerPlan:
    """One KV-cache layer the null model reports, before a release's spec class."""

    name: str
    kind: str                 # full_attention | mamba | sliding_window | mla | chunked_local
    block_size: int
    head_size: int
    page_bytes: int           # the common page size every group is padded to
    sliding_window: int | None = None
    draft: bool = False       # a layer of the EAGLE draft model
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class Named:
    """A scenario setting as one release spells it: the vLLM config class and field."""

    config: str
    name: str


@dataclass(frozen=True)
class Lacking:
    """A scenario setting a release does not have: it runs as if the setting were
    ``behaves_as``; a trace that sets another value is refused there unless
    ``--allow-missing`` names the key (:func:`dropped_settings`)."""

    behaves_as: Any
    why: str


@dataclass(frozen=True)
class Env:
    """A scenario setting a release reads from an environment variable, not a
    config field (0.26-0.28 read the retention interval from
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``): the adapter sets it in the
    engine's process while vLLM builds the engine (:func:`release_environment`)."""

    name: str


Mapping = dict[str, "Named | Lacking | Env"]

# Every engine setting of the scenario format that vLLM reads, by the newest
# release's name (the key is the scenario's; speculative.* reach into the
# speculative block). An adapter overrides the entries its releases spell
# otherwise, or lack (vllm_0_29.release_settings); docs/engines.md shows the
# table for every release (python -m replayer.replay.engines.settings_table).
SETTINGS: Mapping = {
    "block_size": Named("CacheConfig", "block_size"),
    "prefix_match_unit": Named("CacheConfig", "prefix_match_unit"),
    "prefix_cache_retention_interval": Named("CacheConfig", "prefix_cache_retention_interval"),
    "mamba_cache_mode": Named("CacheConfig", "mamba_cache_mode"),
    "enable_mamba_shared_prefix_checkpoint": Named("CacheConfig",
                                                   "enable_mamba_shared_prefix_checkpoint"),
    "enable_prefix_caching": Named("CacheConfig", "enable_prefix_caching"),
    "prefix_caching_hash_algo": Named("CacheConfig", "prefix_caching_hash_algo"),
    "num_gpu_blocks": Named("CacheConfig", "num_gpu_blocks_override"),
    "max_model_len": Named("ModelConfig", "max_model_len"),
    "max_num_batched_tokens": Named("SchedulerConfig", "max_num_batched_tokens"),
    "max_num_seqs": Named("SchedulerConfig", "max_num_seqs"),
    "enable_chunked_prefill": Named("SchedulerConfig", "enable_chunked_prefill"),
    "long_prefill_token_threshold": Named("SchedulerConfig", "long_prefill_token_threshold"),
    "async_scheduling": Named("SchedulerConfig", "async_scheduling"),
    "scheduling_policy": Named("SchedulerConfig", "policy"),
    "tensor_parallel_size": Named("ParallelConfig", "tensor_parallel_size"),
    "decode_context_parallel_size": Named("ParallelConfig", "decode_context_parallel_size"),
    "kv_load_failure_policy": Named("KVTransferConfig", "kv_load_failure_policy"),
    "speculative.method": Named("SpeculativeConfig", "method"),
    "speculative.num_speculative_tokens": Named("SpeculativeConfig", "num_speculative_tokens"),
    "speculative.disable_lookahead_block_hashes": Named("SpeculativeConfig",
                                                        "disable_lookahead_block_hashes"),
}

# CacheConfig / SchedulerConfig fields a trace may leave to vLLM (None), by
# scenario key; each is passed under the release's own name (SETTINGS).
CACHE_KEYS = ("prefix_match_unit", "prefix_caching_hash_algo",
              "prefix_cache_retention_interval", "enable_mamba_shared_prefix_checkpoint")
SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                  "long_prefill_token_threshold")


def given_value(engine: EngineBlock, key: str) -> tuple[bool, Any]:
    """(whether the trace's engine block gives ``key``, its value); dotted keys
    reach into mappings (``speculative.method``)."""
    node: Any = engine.to_header()
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def dropped_settings(engine: EngineBlock, settings: Mapping) -> list[str]:
    """The keys the trace sets to a value its release cannot run (a
    :class:`Lacking` entry whose ``behaves_as`` differs), in table order."""
    out = []
    for key, entry in settings.items():
        given, value = given_value(engine, key)
        if isinstance(entry, Lacking) and given and value != entry.behaves_as:
            out.append(key)
    return out


def refuse_dropped(engine: EngineBlock, settings: Mapping, version: str) -> list[str]:
    """The settings this release drops, each allowed by ``--allow-missing``
    (``engine.allow_missing``); any other one is refused, in one line, so that no
    golden comparison passes on a replay that ignored part of its trace."""
    from replayer.replay.engines.base import UnsupportedByEngine

    dropped = dropped_settings(engine, settings)
    refused = [k for k in dropped if k not in engine.allow_missing]
    if refused:
        key = refused[0]
        _, value = given_value(engine, key)
        entry = settings[key]
        raise UnsupportedByEngine(
            f"vllm {version}: the trace sets engine.{key}: {_yaml(value)}, which vLLM "
            f"{version} does not have ({entry.why}); refused rather than replayed without "
            f"it (--allow-missing {key} replays without it, and the --json engine block "
            "lists it under dropped)")
    return dropped


def _yaml(value: Any) -> str:
    """A value as the scenario's YAML spells it."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _set(engine: EngineBlock, keys: tuple[str, ...], settings: Mapping) -> dict[str, Any]:
    """The settings among ``keys`` the trace pins (the rest stay vLLM's defaults),
    under the release's own names; a key the release lacks is left out
    (:func:`refuse_dropped` decided it may be)."""
    out = {}
    for k in keys:
        v = getattr(engine, k)
        entry = settings[k]
        if v is not None and isinstance(entry, Named):
            out[entry.name] = None if v == RETAIN_DENSE else v
    return out


def release_environment(engine: EngineBlock, settings: Mapping) -> dict[str, str | None]:
    """The environment variables a release reads settings from (:class:`Env`
    entries), each the trace's value or None (unset: the release's own default,
    whatever the caller's environment holds); a given dense retention is unset too."""
    out: dict[str, str | None] = {}
    for key, entry in settings.items():
        if isinstance(entry, Env):
            given, value = given_value(engine, key)
            out[entry.name] = None if not given or value is None or value == RETAIN_DENSE \
                else str(value)
    return out


def cache_kwargs(engine: EngineBlock, settings: Mapping = SETTINGS) -> dict[str, Any]:
    """``CacheConfig`` arguments from a sized engine block (vLLM resolves the rest),
    by the names of the release ``settings`` maps."""
    out: dict[str, Any] = {
        "block_size": engine.block_size,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "num_gpu_blocks_override": engine.num_gpu_blocks,
        **_set(engine, CACHE_KEYS, settings),
    }
    mamba_sizes = [g.block_size for g in engine.kv_groups if g.kind == "mamba"]
    if mamba_sizes:
        out["mamba_cache_mode"] = engine.mamba_cache_mode
        out["mamba_block_size"] = mamba_sizes[0]
    return out


def scheduler_kwargs(engine: EngineBlock) -> dict[str, Any]:
    """``SchedulerConfig`` arguments; async scheduling stays off in the replay."""
    return {"max_model_len": engine.max_model_len, "is_encoder_decoder": False,
            "async_scheduling": False, "policy": engine.scheduling_policy,
            **_set(engine, SCHEDULER_KEYS, SETTINGS)}


def build_config(engine: EngineBlock, executor_cls: type["NullExecutor"], *,
                 cache_args: dict[str, Any] | None = None,
                 speculative_args: dict[str, Any] | None = None,
                 kv_transfer: Any = None, kv_events: bool = False,
                 worker: Any = None) -> VllmConfig:
    """A sized engine block as vLLM's own config objects; vLLM resolves the rest.

    An adapter passes what its release has beyond the shared fields: its
    ``CacheConfig`` arguments (``cache_kwargs`` less what it lacks), extra
    ``SpeculativeConfig`` arguments, a ``KVTransferConfig``; ``kv_events`` turns
    vLLM's KV-cache events on, published to its null publisher, which
    :class:`CoreEngine` fronts with a collector (the ZMQ seam). ``worker``
    (:class:`replayer.replay.engines.worker.executor.ModelArgs`): a real model runs, the
    tiny model of the trace's geometry with its seeded weights, in place of the
    null executor's hand-made layers."""
    spec = engine.speculative
    overrides = {}
    if spec is not None and spec.method == "mtp":
        # vLLM applies a target's callable hf_overrides to the draft's config too.
        overrides["hf_overrides"] = partial(set_mtp_modules, spec.mtp_modules)
    cache_args = dict(cache_args or cache_kwargs(engine))
    extra: dict[str, Any] = {}
    target, draft, dtype = _models(engine, worker, cache_args, overrides, extra)
    model = ModelConfig(model=str(target), skip_tokenizer_init=True,
                        max_model_len=engine.max_model_len, dtype=dtype, **overrides)
    # TP/DCP as the scheduler sees them (the null executor stands for every rank).
    ranks = {k: getattr(engine, k) for k in ("tensor_parallel_size",
                                              "decode_context_parallel_size")
             if getattr(engine, k) != 1}
    parallel = ParallelConfig(distributed_executor_backend=executor_cls, **ranks)
    speculative = None
    if spec is not None:
        speculative = SpeculativeConfig(
            method=spec.method, model=str(draft),
            num_speculative_tokens=spec.num_speculative_tokens,
            target_model_config=model, target_parallel_config=parallel,
            **(speculative_args or {}))
        if speculative.method != spec.method:
            raise _method_taken_from_path(spec.method, speculative.method, draft)
    if kv_transfer is not None:
        extra["kv_transfer_config"] = kv_transfer
    if kv_events:
        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True,
                                                   publisher="null")
    config = VllmConfig(model_config=model,
                        cache_config=CacheConfig(**cache_args),
                        parallel_config=parallel,
                        scheduler_config=SchedulerConfig(**scheduler_kwargs(engine)),
                        device_config=DeviceConfig(device="cpu"), speculative_config=speculative,
                        **extra)
    # On a platform vLLM does not know (CPU without its kernels) it turns the
    # hybrid KV-cache manager off; production GPUs keep it on.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _models(engine: EngineBlock, worker: Any, cache_args: dict[str, Any],
            overrides: dict[str, Any], extra: dict[str, Any]) -> tuple[Any, Any, str]:
    """The target's and draft's model directories and the dtype: the null
    executor's hand-made ones, or the model worker's tiny model (which adds
    what it needs to the cache and model arguments and ``extra`` configs)."""
    spec = engine.speculative
    wide = engine.tensor_parallel_size > 2
    target = WIDE_TARGET_MODEL if wide else TARGET_MODEL
    if engine.model == "kimi-k3":
        target = KIMI_K3_MODEL
    if worker is None:
        return target, (draft_model(spec.method, wide) if spec is not None else None), "float16"
    overrides["enforce_eager"] = True           # no compilation on a CPU replay
    extra["load_config"] = LoadConfig(load_format=worker.load_format())
    cache_args["kv_cache_memory_bytes"] = worker.kv_cache_memory_bytes
    if engine.has_mamba:
        # The recurrent state in float32 (vLLM's --mamba-ssm-cache-dtype): in
        # bf16 its rounding at each prefill chunk boundary moved the tiny
        # model's logprobs by ~0.1, drowning what a wrong state does.
        cache_args["mamba_ssm_cache_dtype"] = "float32"
    return worker.models.target, worker.models.draft, worker.models.dtype


def _method_taken_from_path(asked: str, took: str, draft: Any) -> Exception:
    """vLLM infers an MTP draft's method from words in the draft's path before its
    model type (config/speculative.py, "Automatically detect the method"), so a
    checkout under a folder named e.g. ``dspark`` turns the tiny MTP draft into a
    DSpark one and changes every hit: refused rather than replayed wrong."""
    from replayer.replay.engines.base import EngineError
    from replayer.replay.engines.config.errors import BUILD_FAILED

    words = [w for w in ("eagle-", "eagle3", "dflash", "dspark") if w in str(draft).lower()]
    return EngineError(f"engine.speculative.method {asked}: {BUILD_FAILED} here: vLLM took "
                       f"the draft {draft} for "
                       f"method {took}, from {', '.join(map(repr, words)) or 'its path'} in "
                       "that path; install the replayer where its path holds none of "
                       "'eagle-', 'eagle3', 'dflash', 'dspark'")


def declared_checkpoint_fields(engine: EngineBlock) -> dict[str, Any] | None:
    """The MambaSpec fields ``engine.mamba_prefill_checkpoint_alignment`` declares
    (a state exported inside a prefill chunk, as Mamba2's layers do), the same on
    every release that has them (0.30 on; older ones refuse the field); None where
    the trace declares none and the release's own KDA rule decides."""
    alignment = engine.mamba_prefill_checkpoint_alignment
    if alignment is None:
        return None
    return {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": alignment}


def plan_layers(engine: EngineBlock, dtype_bytes: int) -> list[LayerPlan]:
    """One layer per declared group, plus the EAGLE draft layer and twins.

    vLLM groups layers with equal specs and needs one page size across groups:
    attention head sizes scale inversely with block size and Mamba pages are
    padded to match, as vLLM's own hybrid models do. The draft model's layer
    shares the first attention group's spec; the other groups get a twin layer
    so that every group holds the same number of layers, as vLLM's grouping
    assumes. ``speculative.draft_group`` names another group for the draft
    layer to join (a real draft's layer has its target's geometry, so it
    lands in the group of that spec). The draft layer comes last, as a real
    drafter's do (vLLM loads the draft model after the target, and the runner's
    ``get_kv_cache_spec`` lists layers in registration order): 0.31 and 0.32
    find an MTP drafter's group by that alone (``_annotate_eagle_groups``: the
    group holding the last registered layer), and a twin listed after it
    would flag the twin's group instead.
    """
    groups = engine.kv_groups
    draft_index = None
    if engine.speculative is not None:
        draft_index = engine.speculative.draft_group
        if draft_index is None:
            draft_index = next((i for i, g in enumerate(groups)
                                if g.kind in ("full_attention", "mla")), None)
    sizes = [g.block_size for g in groups]
    largest = max(sizes)
    for g, bs in zip(groups, sizes):
        if g.kind != "mamba" and largest % bs:
            raise ValueError(f"attention block size {bs} must divide the largest group "
                             f"block size {largest}")
    page = 2 * largest * HEAD_SIZE * dtype_bytes
    plans: list[LayerPlan] = []
    draft: LayerPlan | None = None
    for i, (g, bs) in enumerate(zip(groups, sizes)):
        kind = g.kind
        plans.append(LayerPlan(f"model.layers.{i}.{kind}", kind, bs, HEAD_SIZE * largest // bs,
                               page, g.sliding_window,
                               attention_chunk_size=g.attention_chunk_size))
        if i == draft_index:
            draft = replace(plans[-1], name="draft.layers.0.attn", draft=True)
    if draft is not None:
        for p in list(plans):
            if replace(p, name=draft.name, draft=True) != draft:
                plans.append(replace(p, name=f"{p.name}.twin"))
        plans.append(draft)
    return plans
