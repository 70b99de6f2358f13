"""The engine block of a header or scenario: geometry and settings, by vLLM's names.

Only what a trace sets is stored; a field left out means vLLM's own default, so
a header never pins a value nobody chose. The one definition of which keys
exist lives here; unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

from typing import Any

from .errors import TraceError
from .limits import check_engine_bounds, check_int

GROUP_KINDS = ("full_attention", "mamba", "sliding_window", "mla")

# key -> (python types accepted, doc)
ENGINE_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "block_size": ((int,), "KV block size in tokens (CacheConfig.block_size)"),
    "prefix_match_unit": ((int,), "hash block size; omitted: the block size"),
    "kv_groups": ((list,), "KV-cache groups, each {kind, block_size?, sliding_window?}"),
    "speculative": ((dict,), "{method, num_speculative_tokens, disable_lookahead_block_hashes}"),
    "prefix_cache_retention_interval": ((int, type(None)), "Mamba/SWA checkpoint interval"),
    "mamba_cache_mode": ((str,), "'align' (default with a Mamba group) or 'none'"),
    "enable_mamba_shared_prefix_checkpoint": ((bool,), "CacheConfig flag of the same name"),
    "enable_prefix_caching": ((bool,), "CacheConfig flag (default true)"),
    "prefix_caching_hash_algo": ((str,), "sha256 (default), sha256_cbor, xxhash, ..."),
    "hash_seed": ((str, int, type(None)), "PYTHONHASHSEED the engine ran with; null: unset"),
    "max_num_batched_tokens": ((int,), "SchedulerConfig budget per step"),
    "max_num_seqs": ((int,), "SchedulerConfig concurrent sequences"),
    "max_model_len": ((int,), "omitted: the longest request in the trace, rounded up"),
    "num_gpu_blocks": ((int,), "KV blocks (num_gpu_blocks_override)"),
    "enable_chunked_prefill": ((bool,), "SchedulerConfig flag (default true)"),
    "long_prefill_token_threshold": ((int,), "SchedulerConfig field"),
    "async_scheduling": ((bool,), "SchedulerConfig flag (default false here)"),
    "scheduling_policy": ((str,), "SchedulerConfig.policy: fcfs (default) or priority"),
    "vocab_size": ((int,), "vocabulary of the synthetic tokens (default 32000)"),
    "connector": ((str, type(None)), "KV connector: mooncake_store (omitted: none)"),
    "connector_config": ((dict,), "the connector's extra config, by vLLM's names"),
}

CONNECTORS = ("mooncake_store",)
# MooncakeStoreConnector's kv_connector_extra_config keys the replay honours.
CONNECTOR_CONFIG_KEYS = ("load_async", "lookup_async", "save_decode_cache", "enable_lookup",
                         "cache_prefix", "enable_group_semantics")

SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "disable_lookahead_block_hashes")
SPECULATIVE_METHODS = ("eagle", "eagle3", "mtp")
GROUP_KEYS = ("kind", "block_size", "sliding_window")

DEFAULT_VOCAB_SIZE = 32000


def _check_int(where: str, key: str, value: Any, *, minimum: int = 1) -> None:
    check_int(where, f"engine.{key}", value, minimum)


def validate_engine(where: str, engine: Any) -> dict[str, Any]:
    """Check an engine block and return a normalised copy (kv_groups expanded)."""
    if not isinstance(engine, dict):
        raise TraceError(where, "engine must be a mapping")
    for key, value in engine.items():
        if key not in ENGINE_KEYS:
            raise TraceError(where, f"unknown engine key {key!r} (known: {', '.join(ENGINE_KEYS)})")
        types, _ = ENGINE_KEYS[key]
        if isinstance(value, bool) and bool not in types:
            raise TraceError(where, f"engine.{key} has the wrong type bool")
        if not isinstance(value, types):
            raise TraceError(where, f"engine.{key} has the wrong type {type(value).__name__}")
    out = dict(engine)
    for key in ("block_size", "prefix_match_unit", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "num_gpu_blocks", "vocab_size", "long_prefill_token_threshold"):
        if key in out:
            _check_int(where, key, out[key])
    rit = out.get("prefix_cache_retention_interval")
    if rit is not None:
        _check_int(where, "prefix_cache_retention_interval", rit, minimum=0)
    if out.get("mamba_cache_mode", "align") not in ("align", "none"):
        raise TraceError(where, f"engine.mamba_cache_mode must be 'align' or 'none', "
                                f"got {out['mamba_cache_mode']!r}")
    if out.get("connector") is not None and out["connector"] not in CONNECTORS:
        raise TraceError(where, f"engine.connector {out['connector']!r} is not supported "
                                f"(known: {', '.join(CONNECTORS)})")
    if out.get("scheduling_policy", "fcfs") not in SCHEDULING_POLICIES:
        raise TraceError(where, f"engine.scheduling_policy {out['scheduling_policy']!r}: "
                                f"expected one of {', '.join(SCHEDULING_POLICIES)}")
    if "connector_config" in out and not out.get("connector"):
        raise TraceError(where, "engine.connector_config needs engine.connector")
    for k, v in (out.get("connector_config") or {}).items():
        if k not in CONNECTOR_CONFIG_KEYS:
            raise TraceError(where, f"unknown key {k!r} in engine.connector_config "
                                    f"(known: {', '.join(CONNECTOR_CONFIG_KEYS)})")
    groups = out.get("kv_groups", [{"kind": "full_attention"}])
    if not groups:
        raise TraceError(where, "engine.kv_groups must list at least one group")
    norm_groups = []
    for i, g in enumerate(groups):
        if isinstance(g, str):
            g = {"kind": g}
        if not isinstance(g, dict):
            raise TraceError(where, f"engine.kv_groups[{i}] must be a mapping")
        for k in g:
            if k not in GROUP_KEYS:
                raise TraceError(where, f"unknown key {k!r} in engine.kv_groups[{i}] "
                                        f"(known: {', '.join(GROUP_KEYS)})")
        kind = g.get("kind")
        if kind not in GROUP_KINDS:
            raise TraceError(where, f"engine.kv_groups[{i}].kind {kind!r} is not a group kind "
                                    f"vLLM can build (known: {', '.join(GROUP_KINDS)})")
        if kind == "sliding_window":
            _check_int(where, f"kv_groups[{i}].sliding_window", g.get("sliding_window"))
        elif "sliding_window" in g:
            raise TraceError(where, f"engine.kv_groups[{i}]: sliding_window only applies "
                                    f"to kind sliding_window")
        if "block_size" in g:
            _check_int(where, f"kv_groups[{i}].block_size", g["block_size"])
        norm_groups.append(dict(g))
    kinds = [g["kind"] for g in norm_groups]
    if "mla" in kinds and len(set(kinds)) > 1:
        raise TraceError(where, "engine.kv_groups: an mla group cannot be mixed with other kinds")
    if all(k == "mamba" for k in kinds):
        raise TraceError(where, "engine.kv_groups: a model needs at least one attention group "
                                "beside mamba")
    out["kv_groups"] = norm_groups
    check_engine_bounds(where, out)     # sizes that would exhaust memory, hash_seed, ...
    spec = out.get("speculative")
    if spec is not None:
        for k in spec:
            if k not in SPECULATIVE_KEYS:
                raise TraceError(where, f"unknown key {k!r} in engine.speculative "
                                        f"(known: {', '.join(SPECULATIVE_KEYS)})")
        if spec.get("method") not in SPECULATIVE_METHODS:
            raise TraceError(where, f"engine.speculative.method must be one of "
                                    f"{', '.join(SPECULATIVE_METHODS)}, got {spec.get('method')!r}")
        _check_int(where, "speculative.num_speculative_tokens",
                   spec.get("num_speculative_tokens", 1))
        if not isinstance(spec.get("disable_lookahead_block_hashes", False), bool):
            raise TraceError(where, "engine.speculative.disable_lookahead_block_hashes must be a bool")
    return out


def vocab_size(engine: dict[str, Any]) -> int:
    return int(engine.get("vocab_size", DEFAULT_VOCAB_SIZE))
