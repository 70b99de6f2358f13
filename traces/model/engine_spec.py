"""The engine block of a header or scenario: geometry and settings, by vLLM's names.

:class:`EngineBlock` is the one typed form every reader uses: built by
:meth:`EngineBlock.from_dict` (validation), frozen, every default resolved,
one documented field per key. Unknown keys are errors, never silently ignored.

Two kinds of default. The replayer's own (block size 16, one full-attention
group, ``align`` for Mamba, vocabulary 32000, ...) are filled in here. A few
settings are vLLM's to default and differ between releases (scheduler budgets,
the prefix-match unit, the retention interval, ...): left out they stay None,
and the adapter leaves them to the vLLM it builds. ``max_model_len`` and
``num_gpu_blocks`` depend on the trace's requests: :meth:`EngineBlock.sized_for`
fills them, the one place those derived defaults are decided.

A header keeps only what its author set (:meth:`EngineBlock.to_header` gives
back exactly that), so a header never pins a value nobody chose.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from math import ceil
from typing import Any, Mapping, Sequence

from traces.model.errors import TraceError, reject_unknown_keys
from traces.model.sizes import parse_size
from traces.model.limits import check_engine_bounds, check_int

GROUP_KINDS = ("full_attention", "mamba", "sliding_window", "mla", "chunked_local")
# Kinds a draft model's attention layer can join: never Mamba, and never chunked
# local attention, whose lookup asserts no EAGLE drop reaches it (vLLM: "Hybrid KV
# cache is not supported for eagle + chunked local attention").
DRAFT_GROUP_KINDS = ("full_attention", "mla", "sliding_window")
CONNECTORS = ("mooncake_store", "offloading")
# vLLM's KVTransferConfig.kv_role, spelled as vLLM spells it (engine.connector_config.kv_role).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Per connector: the engine.connector_config keys the replay honours, by vLLM's
# names; kv_role is KVTransferConfig's own field, the rest its connector's
# kv_connector_extra_config. A connector that honours no kv_role leaves it out.
CONNECTOR_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "mooncake_store": ("kv_role", "load_async", "lookup_async", "save_decode_cache",
                       "enable_lookup", "cache_prefix", "enable_group_semantics"),
    # vLLM 0.33's OffloadingConnector (offloading/config.py, kv_offload/cpu/spec.py,
    # kv_offload/base.py, offloading/scheduler.py); cpu_bytes_to_use is required.
    "offloading": ("cpu_bytes_to_use", "block_size", "blocks_per_chunk", "spec_name",
                   "eviction_policy", "store_threshold", "max_tracker_size",
                   "offload_prompt_only", "sync_load_budget_bytes"),
}
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")
# "all" (cache every block's state) is 0.29-0.31's; 0.32 removed it.
MAMBA_CACHE_MODES = ("align", "none", "all")
# The bundled model configs vLLM reads as the target (replayer/models): the tiny
# Llama (default; its 8-head twin above TP 2), or Kimi-K3's shape (its layer
# pattern and MLA/KDA dimensions, no weights: docs/kimi-k3.md).
TARGET_MODELS = ("tiny-llama", "kimi-k3")
# vLLM's additional_config["kda_prefill_backend"] as resolved on the GPU ("auto"
# picks flashkda on SM90/SM10x with bf16, head_dim 128 and a bounded gate).
KDA_PREFILL_BACKENDS = ("flashkda", "flashinfer", "triton")

DEFAULT_BLOCK_SIZE = 16       # CacheConfig.DEFAULT_BLOCK_SIZE in every release served
DEFAULT_VOCAB_SIZE = 32000
# A given ``prefix_cache_retention_interval: null``: vLLM retains checkpoints densely
# (its None). Kept apart from None here, which means "left to vLLM's default".
RETAIN_DENSE = "dense"


def _doc(text: str, *types: type, vllm_default: bool = False) -> dict[str, Any]:
    return {"doc": text, "types": types, "vllm_default": vllm_default}


@dataclass(frozen=True)
class KvGroup:
    """One KV-cache group the null model declares."""

    kind: str = field(metadata=_doc(
        "full_attention | mamba | sliding_window | mla | chunked_local", str))
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=_doc(
        "tokens per block; omitted: the engine's block_size (16 when that is omitted)", int))
    sliding_window: int | None = field(default=None, metadata=_doc(
        "window in tokens (kind sliding_window only)", int))
    attention_chunk_size: int | None = field(default=None, metadata=_doc(
        "chunk in tokens (kind chunked_local only; vLLM's ChunkedLocalAttentionSpec field): "
        "a token attends only to tokens of its own chunk", int))


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding (EAGLE/MTP): vLLM's SpeculativeConfig, the draft is the trace."""

    method: str = field(metadata=_doc("eagle | eagle3 | mtp | dflash | dspark", str))
    num_speculative_tokens: int = field(default=1, metadata=_doc("draft tokens per step", int))
    disable_lookahead_block_hashes: bool = field(default=False, metadata=_doc(
        "0.33's flag: no lookahead block hashes, so the EAGLE drop applies", bool))
    mtp_modules: int = field(default=1, metadata=_doc(
        "method mtp only: the draft's MTP modules (num_nextn_predict_layers); above 1 with "
        "num_speculative_tokens > 1 it is multi-module MTP, which reads "
        "num_speculative_tokens prefill tokens ahead (1 otherwise)", int))
    draft_group: int | None = field(default=None, metadata=_doc(
        "index into kv_groups of the group whose spec the draft model's attention layer "
        "shares, so vLLM 0.33 marks that group the EAGLE group (is_draft); None: the first "
        "full_attention or mla group", int))


@dataclass(frozen=True)
class EngineBlock:
    """A trace's engine, every field resolved (None: vLLM's default, see each doc)."""

    block_size: int = field(metadata=_doc(
        "KV block size in tokens (CacheConfig.block_size); omitted: the smallest attention "
        "group's, else 16", int))
    kv_groups: tuple[KvGroup, ...] = field(metadata=_doc(
        "KV-cache groups, each {kind, block_size?, sliding_window?}; omitted: one "
        "full-attention group", list))
    prefix_match_unit: int | None = field(default=None, metadata=_doc(
        "hash block size (CacheConfig.prefix_match_unit); None: vLLM's (the block size)", int,
        vllm_default=True))
    speculative: Speculative | None = field(default=None, metadata=_doc(
        "{method, num_speculative_tokens, disable_lookahead_block_hashes}; None: off", dict))
    prefix_cache_retention_interval: int | str | None = field(default=None, metadata=_doc(
        "Mamba/SWA checkpoint interval; a given null is RETAIN_DENSE; None: vLLM's default",
        int, type(None), vllm_default=True))
    mamba_cache_mode: str = field(default="align", metadata=_doc(
        "'align' (default), 'none', or 'all' (vLLM 0.29-0.31 only: every block's state "
        "is cached); applies with a Mamba group", str))
    enable_mamba_shared_prefix_checkpoint: bool | None = field(default=None, metadata=_doc(
        "CacheConfig flag of the same name; None: vLLM's default (off)", bool,
        vllm_default=True))
    enable_prefix_caching: bool = field(default=True, metadata=_doc(
        "CacheConfig flag (default true)", bool))
    prefix_caching_hash_algo: str | None = field(default=None, metadata=_doc(
        "sha256, sha256_cbor, xxhash, ...; None: vLLM's default (sha256)", str,
        vllm_default=True))
    hash_seed: str | None = field(default=None, metadata=_doc(
        "PYTHONHASHSEED the engine ran with; None: unset", str, int, type(None)))
    max_num_batched_tokens: int | None = field(default=None, metadata=_doc(
        "SchedulerConfig budget per step; None: vLLM's default", int, vllm_default=True))
    max_num_seqs: int | None = field(default=None, metadata=_doc(
        "SchedulerConfig concurrent sequences; None: vLLM's default", int, vllm_default=True))
    max_model_len: int | None = field(default=None, metadata=_doc(
        "omitted: the longest request (+ draft room, at least long_prefill_token_threshold), "
        "rounded up to the largest block unless num_gpu_blocks is given (see sized_for)", int))
    num_gpu_blocks: int | None = field(default=None, metadata=_doc(
        "KV blocks (num_gpu_blocks_override); omitted: room for four longest requests in "
        "every group (see sized_for)", int))
    enable_chunked_prefill: bool | None = field(default=None, metadata=_doc(
        "SchedulerConfig flag; None: vLLM's default (true)", bool, vllm_default=True))
    long_prefill_token_threshold: int | None = field(default=None, metadata=_doc(
        "SchedulerConfig field; None: vLLM's default", int, vllm_default=True))
    async_scheduling: bool = field(default=False, metadata=_doc(
        "SchedulerConfig flag as recorded; the replay steps synchronously", bool))
    scheduling_policy: str = field(default="fcfs", metadata=_doc(
        "SchedulerConfig.policy: fcfs (default) or priority", str))
    tensor_parallel_size: int = field(default=1, metadata=_doc(
        "ParallelConfig.tensor_parallel_size (default 1): what the scheduler sees, and "
        "with a connector one store worker per rank; a multiple of "
        "decode_context_parallel_size", int))
    decode_context_parallel_size: int = field(default=1, metadata=_doc(
        "ParallelConfig.decode_context_parallel_size (default 1): DCP shards the KV "
        "blocks over this many ranks, so vLLM scales the scheduler block and hit "
        "alignment by it", int))
    model: str | None = field(default=None, metadata=_doc(
        "the bundled model config vLLM reads as the target: tiny-llama (None: the default, "
        "its 8-head twin above TP 2) or kimi-k3 (Kimi-K3's 93-layer pattern and MLA/KDA "
        "dimensions, replayer/models/kimi-k3: an MLA model, so DCP may equal TP)", str))
    kda_prefill_backend: str | None = field(default=None, metadata=_doc(
        "with a Mamba group: its layers are Kimi KDA layers, and this is vLLM's "
        "additional_config kda_prefill_backend as resolved: flashkda (the GPU's 'auto' "
        "choice; the layers export internal prefill checkpoints: MambaSpec "
        "num_prefill_checkpoint_blocks and prefill_checkpoint_alignment as vLLM's "
        "KimiK3DeltaAttention sets them), flashinfer or triton (none); None: a plain "
        "Mamba spec", str))
    mamba_prefill_checkpoint_alignment: int | None = field(default=None, metadata=_doc(
        "with a Mamba group: its layers export a state inside a prefill chunk (vLLM's "
        "MambaSpec num_prefill_checkpoint_blocks 1 and this prefill_checkpoint_alignment, "
        "in tokens), as vLLM 0.32's and 0.33's Mamba2 layers do (MambaMixer2: 1), so the "
        "scheduler need not end a chunk where a state is kept; None: no such export "
        "(Kimi KDA layers: kda_prefill_backend says it)", int))
    vocab_size: int = field(default=DEFAULT_VOCAB_SIZE, metadata=_doc(
        "vocabulary of the synthetic tokens (default 32000)", int))
    connector: str | None = field(default=None, metadata=_doc(
        "KV connector: mooncake_store or offloading (vLLM's OffloadingConnector, CPU "
        "offload, vLLM 0.33); None: none", str, type(None)))
    connector_config: Mapping[str, Any] = field(default_factory=dict, hash=False, metadata=_doc(
        "the connector's settings, by vLLM's names: kv_role (KVTransferConfig's: "
        "kv_producer, kv_consumer or kv_both, the default) and its extra config", dict))
    kv_load_failure_policy: str | None = field(default=None, metadata=_doc(
        "KVTransferConfig.kv_load_failure_policy: fail (vLLM's default: a request whose "
        "store load fails ends with an error) or recompute (its failed blocks are "
        "computed again); needs connector", str, type(None)))
    mooncake_global_segment_size: int | None = field(default=None, metadata=_doc(
        "Mooncake's global_segment_size: the store pool each rank's client mounts, in "
        "bytes or as 64MB/2GB (the pool is ranks x this); the memory store evicts its "
        "oldest objects beyond it; omitted: Mooncake's default (4 GiB, no pressure "
        "in the fixtures); --store-capacity overrides it; needs connector", int, str))
    prefill_instance: Mapping[str, Any] | None = field(default=None, hash=False, metadata=_doc(
        "a prefill/decode pair sharing one store: this block is the decode instance, "
        "and a second engine of the same geometry with this mapping's connector_config "
        "(e.g. {kv_role: kv_producer}) prefills each request first, with one output "
        "token, as a disaggregated proxy sends it; needs connector mooncake_store",
        dict, type(None)))
    # What the header or scenario said, normalised: to_header() gives it back.
    given: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False,
                                     hash=False)
    # Lines saying which left-out settings sized_for chose because vLLM's own
    # default would be refused (said as notes on stderr, never in the JSON).
    chosen: tuple[str, ...] = field(default=(), repr=False, compare=False, hash=False)
    # Settings the replay may drop on a release that lacks them (--allow-missing
    # KEY, scenario keys such as speculative.disable_lookahead_block_hashes);
    # never part of a header. Any other such setting is refused.
    allow_missing: tuple[str, ...] = field(default=(), repr=False, compare=False, hash=False)

    # -- reading --------------------------------------------------------------
    @classmethod
    def from_dict(cls, where: str, raw: Any) -> "EngineBlock":
        """Validate an engine block; errors name ``where`` and the key."""
        return _build(str(where), raw)

    def to_header(self) -> dict[str, Any]:
        """The block as a header or scenario holds it: only what was given."""
        return copy.deepcopy(dict(self.given))

    def allowing(self, where: str, keys: Sequence[str]) -> "EngineBlock":
        """A copy that may drop ``keys`` on a release lacking them (``--allow-missing``);
        each must be a setting of the scenario format (``engine.`` prefix optional)."""
        names = tuple(k.removeprefix("engine.") for k in keys)
        for name in names:
            top, _, sub = name.partition(".")
            known = top in ENGINE_KEYS and (not sub or (top == "speculative"
                                                       and sub in SPECULATIVE_KEYS))
            if not known:
                raise TraceError(f"{where} {name}", "not an engine setting of the scenario "
                                 "format (e.g. enable_mamba_shared_prefix_checkpoint, "
                                 "speculative.disable_lookahead_block_hashes)")
        return replace(self, allow_missing=tuple(dict.fromkeys((*self.allow_missing, *names))))

    def prefill_engine(self) -> "EngineBlock":
        """A pair's prefill instance (``prefill_instance``): this block with that
        instance's ``connector_config``, and no prefill instance of its own."""
        config = dict((self.prefill_instance or {}).get("connector_config") or {})
        given = {k: v for k, v in self.given.items() if k != "prefill_instance"}
        if config:
            given["connector_config"] = copy.deepcopy(config)
        else:
            given.pop("connector_config", None)
        return replace(self, connector_config=config, prefill_instance=None, given=given)

    def with_settings(self, **changes: Any) -> "EngineBlock":
        """A copy with some keys set as if the header had said so (validated again)."""
        return EngineBlock.from_dict("engine", {**self.to_header(), **changes})

    # -- derived ----------------------------------------------------------------
    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0 without speculative decoding)."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == "mamba" for g in self.kv_groups)

    def sized_for(self, longest_request: int) -> "EngineBlock":
        """``max_model_len`` and ``num_gpu_blocks`` filled in for a trace whose
        longest request (prompt + output) has ``longest_request`` tokens, and
        scheduler budgets vLLM accepts where vLLM's own defaults would make it
        refuse to start (see :func:`_accepted_budgets`).

        ``max_model_len``: that, plus room for the drafts, rounded up to the
        largest block (not rounded when ``num_gpu_blocks`` is given: vLLM
        refuses a length the pool cannot hold); ``num_gpu_blocks``: four such requests in every
        group. Values the trace set are kept. Every value chosen because
        vLLM's default would be refused is said in ``chosen``.
        """
        sizes = [g.block_size for g in self.kv_groups]
        unit = max(sizes)
        max_len = self.max_model_len
        if max_len is None:
            needed = longest_request + self.num_speculative_tokens + 1
            if self.long_prefill_token_threshold is not None:
                needed = max(needed, self.long_prefill_token_threshold)
            max_len = ceil(needed / unit) * unit
            if self.num_gpu_blocks is not None:
                # A given pool must hold one request of max_model_len or vLLM
                # refuses to start: ask for no more than the trace needs.
                max_len = needed
        blocks = self.num_gpu_blocks
        if blocks is None:
            blocks = 4 * ceil(max_len / min(sizes)) * len(sizes)
        budgets, said = _accepted_budgets(self, max_len)
        return replace(self, max_model_len=max_len, num_gpu_blocks=blocks, **budgets,
                       chosen=(*self.chosen, *said))


# vLLM's SchedulerConfig defaults (0.29-0.33 alike): 2048 tokens and 128
# sequences per step.
VLLM_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_MAX_NUM_SEQS = 128


def _accepted_budgets(block: EngineBlock, max_len: int) -> tuple[dict[str, int], list[str]]:
    """Scheduler budgets for the settings a trace left out, where vLLM's defaults
    would be refused by ``SchedulerConfig.verify_max_model_len``: at least as
    many batched tokens as sequences, and (chunked prefill off) as
    ``max_model_len``. Returns the values and one line per value chosen."""
    out: dict[str, int] = {}
    said: list[str] = []
    seqs, tokens = block.max_num_seqs, block.max_num_batched_tokens
    if tokens is None:
        floor = seqs or 0
        if block.enable_chunked_prefill is False:
            floor = max(floor, max_len)
        if floor > VLLM_MAX_NUM_BATCHED_TOKENS:
            out["max_num_batched_tokens"] = floor
            why = ("max_num_seqs" if floor == seqs else
                   "max_model_len, chunked prefill being off")
            said.append(f"engine.max_num_batched_tokens left out: {floor} chosen (vLLM's "
                        f"default {VLLM_MAX_NUM_BATCHED_TOKENS} is below {why}, which vLLM "
                        "refuses)")
    elif seqs is None and tokens < VLLM_MAX_NUM_SEQS:
        out["max_num_seqs"] = tokens
        said.append(f"engine.max_num_seqs left out: {tokens} chosen (vLLM's default "
                    f"{VLLM_MAX_NUM_SEQS} exceeds max_num_batched_tokens {tokens}, which vLLM "
                    "refuses)")
    return out, said


KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
_NOT_KEYS = ("given", "chosen", "allow_missing")
ENGINE_KEYS: dict[str, str] = {f.name: f.metadata["doc"] for f in fields(EngineBlock)
                               if f.name not in _NOT_KEYS}
SPECULATIVE_KEYS = tuple(f.name for f in fields(Speculative))
GROUP_KEYS = tuple(f.name for f in fields(KvGroup))
_TYPES = {f.name: f.metadata["types"] for f in fields(EngineBlock)
          if f.name not in _NOT_KEYS}
_INT_KEYS = ("block_size", "prefix_match_unit", "max_num_batched_tokens", "max_num_seqs",
             "max_model_len", "num_gpu_blocks", "vocab_size", "long_prefill_token_threshold",
             "tensor_parallel_size", "decode_context_parallel_size")


def _check_int(where: str, key: str, value: Any, *, minimum: int = 1) -> int:
    return check_int(where, f"engine.{key}", value, minimum)


def _check_types(where: str, engine: dict[str, Any]) -> None:
    for key, value in engine.items():
        if key not in _TYPES:
            raise TraceError(where, f"unknown engine key {key!r} (known: {', '.join(_TYPES)})")
        types = _TYPES[key]
        if isinstance(value, bool) and bool not in types:
            raise TraceError(where, f"engine.{key} has the wrong type bool")
        if not isinstance(value, types):
            raise TraceError(where, f"engine.{key} has the wrong type {type(value).__name__}")


def _groups(where: str, raw: list[Any], default_size: int) -> tuple[list[dict], tuple[KvGroup, ...]]:
    """(the groups as given, normalised to mappings; the resolved groups)."""
    if not raw:
        raise TraceError(where, "engine.kv_groups must list at least one group")
    given, groups = [], []
    for i, g in enumerate(raw):
        if isinstance(g, str):
            g = {"kind": g}
        if not isinstance(g, dict):
            raise TraceError(where, f"engine.kv_groups[{i}] must be a mapping")
        reject_unknown_keys(where, f"engine.kv_groups[{i}]", g, GROUP_KEYS)
        kind = g.get("kind")
        if kind not in GROUP_KINDS:
            raise TraceError(where, f"engine.kv_groups[{i}].kind {kind!r} is not a group kind "
                                    f"vLLM can build (known: {', '.join(GROUP_KINDS)})")
        window = None
        if kind == "sliding_window":
            window = _check_int(where, f"kv_groups[{i}].sliding_window", g.get("sliding_window"))
        elif "sliding_window" in g:
            raise TraceError(where, f"engine.kv_groups[{i}]: sliding_window only applies "
                                    f"to kind sliding_window")
        chunk = None
        if kind == "chunked_local":
            chunk = _check_int(where, f"kv_groups[{i}].attention_chunk_size",
                               g.get("attention_chunk_size"))
        elif "attention_chunk_size" in g:
            raise TraceError(where, f"engine.kv_groups[{i}]: attention_chunk_size only applies "
                                    f"to kind chunked_local")
        if "block_size" in g:
            _check_int(where, f"kv_groups[{i}].block_size", g["block_size"])
        given.append(dict(g))
        groups.append(KvGroup(kind, int(g.get("block_size", default_size)), window, chunk))
    kinds = [g.kind for g in groups]
    if all(k == "mamba" for k in kinds):
        raise TraceError(where, "engine.kv_groups: a model needs at least one attention group "
                                "beside mamba")
    return given, tuple(groups)


def _speculative(where: str, spec: dict[str, Any],
                 groups: tuple[KvGroup, ...]) -> Speculative:
    reject_unknown_keys(where, "engine.speculative", spec, SPECULATIVE_KEYS)
    if spec.get("method") not in SPECULATIVE_METHODS:
        raise TraceError(where, f"engine.speculative.method must be one of "
                                f"{', '.join(SPECULATIVE_METHODS)}, got {spec.get('method')!r}")
    n = _check_int(where, "speculative.num_speculative_tokens",
                   spec.get("num_speculative_tokens", 1))
    lookahead_off = spec.get("disable_lookahead_block_hashes", False)
    if not isinstance(lookahead_off, bool):
        raise TraceError(where, "engine.speculative.disable_lookahead_block_hashes must be a bool")
    modules = _check_int(where, "speculative.mtp_modules", spec.get("mtp_modules", 1))
    if "mtp_modules" in spec and spec["method"] != "mtp":
        raise TraceError(where, "engine.speculative.mtp_modules only applies to method mtp")
    draft_group = spec.get("draft_group")
    if draft_group is not None:
        if isinstance(draft_group, bool) or not isinstance(draft_group, int) or not (
                0 <= draft_group < len(groups)):
            raise TraceError(where, f"engine.speculative.draft_group must index "
                                    f"engine.kv_groups (0 to {len(groups) - 1}), got "
                                    f"{draft_group!r}")
        if groups[draft_group].kind not in DRAFT_GROUP_KINDS:
            raise TraceError(where, f"engine.speculative.draft_group {draft_group} is a "
                                    f"{groups[draft_group].kind} group; the draft's attention "
                                    f"layer joins one of: {', '.join(DRAFT_GROUP_KINDS)}")
    elif "chunked_local" in [g.kind for g in groups] and not any(
            g.kind in ("full_attention", "mla") for g in groups):
        # No group for the draft: vLLM flags every group, the chunked one too.
        raise TraceError(where, "engine.speculative beside a chunked_local group needs a "
                                "group for the draft (a full_attention or mla group, or "
                                "speculative.draft_group): vLLM does not support the EAGLE "
                                "drop on chunked local attention")
    return Speculative(spec["method"], n, lookahead_off, modules, draft_group)


def _choice(where: str, key: str, value: Any, known: tuple[str, ...], message: str) -> None:
    if value not in known:
        raise TraceError(where, message.format(key=key, value=value, known=", ".join(known)))


OFFLOADING_EVICTION_POLICIES = ("lru", "arc")


def _offloading_config(where: str, raw: dict[str, Any], config: dict[str, Any]) -> None:
    """``connector: offloading``: vLLM's CPUOffloadingSpec refuses to start without
    ``cpu_bytes_to_use``, and the Mooncake segment size means nothing to it."""
    if not config.get("cpu_bytes_to_use"):
        raise TraceError(where, "engine.connector offloading needs "
                                "engine.connector_config.cpu_bytes_to_use (bytes of CPU "
                                "memory for offloaded blocks, as vLLM requires)")
    for key in ("cpu_bytes_to_use", "block_size", "blocks_per_chunk", "store_threshold",
                "max_tracker_size", "sync_load_budget_bytes"):
        if key in config:
            check_int(where, f"engine.connector_config.{key}", config[key],
                      0 if key in ("store_threshold", "sync_load_budget_bytes") else 1)
    if not isinstance(config.get("offload_prompt_only", True), bool):
        raise TraceError(where, "engine.connector_config.offload_prompt_only must be a bool")
    if config.get("eviction_policy", "lru") not in OFFLOADING_EVICTION_POLICIES:
        raise TraceError(where, "engine.connector_config.eviction_policy must be one of "
                                f"{', '.join(OFFLOADING_EVICTION_POLICIES)}, got "
                                f"{config['eviction_policy']!r}")
    if raw.get("mooncake_global_segment_size") is not None:
        raise TraceError(where, "engine.mooncake_global_segment_size needs engine.connector "
                                "mooncake_store (offloading sizes its CPU tier with "
                                "connector_config.cpu_bytes_to_use)")


def _prefill_instance(where: str, raw: dict[str, Any]) -> None:
    """``engine.prefill_instance``: its own ``connector_config`` (the same keys as
    the block's), over a MooncakeStore both instances share."""
    if raw.get("connector") != "mooncake_store":
        raise TraceError(where, "engine.prefill_instance needs engine.connector "
                                "mooncake_store (the store the two instances share)")
    reject_unknown_keys(where, "engine.prefill_instance", raw["prefill_instance"],
                        ("connector_config",))
    config = raw["prefill_instance"].get("connector_config") or {}
    if not isinstance(config, dict):
        raise TraceError(where, "engine.prefill_instance.connector_config must be a mapping")
    reject_unknown_keys(where, "engine.prefill_instance.connector_config", config,
                        CONNECTOR_CONFIG_KEYS["mooncake_store"])
    if "kv_role" in config:
        _choice(where, "prefill_instance.connector_config.kv_role", config["kv_role"],
                KV_ROLES, "engine.{key} must be one of {known}, got {value!r}")
    for key, value in config.items():
        if key == "cache_prefix" and not isinstance(value, str):
            raise TraceError(where, "engine.prefill_instance.connector_config.cache_prefix "
                                    "must be a string")
        if key not in ("kv_role", "cache_prefix") and not isinstance(value, bool):
            raise TraceError(where, f"engine.prefill_instance.connector_config.{key} must be "
                                    "true or false")


def _build(where: str, raw: Any) -> EngineBlock:
    if not isinstance(raw, dict):
        raise TraceError(where, "engine must be a mapping")
    _check_types(where, raw)
    for key in _INT_KEYS:
        if key in raw:
            _check_int(where, key, raw[key])
    check_engine_bounds(where, raw)     # sizes that would exhaust memory, hash_seed, ...
    if raw.get("prefix_cache_retention_interval") is not None:
        _check_int(where, "prefix_cache_retention_interval",
                   raw["prefix_cache_retention_interval"], minimum=0)
    _choice(where, "mamba_cache_mode", raw.get("mamba_cache_mode", "align"), MAMBA_CACHE_MODES,
            "engine.{key} must be one of {known}, got {value!r}")
    if raw.get("model") is not None:
        _choice(where, "model", raw["model"], TARGET_MODELS,
                "engine.{key} {value!r} is not a bundled model (known: {known})")
    if raw.get("kda_prefill_backend") is not None:
        _choice(where, "kda_prefill_backend", raw["kda_prefill_backend"], KDA_PREFILL_BACKENDS,
                "engine.{key} must be one of {known}, got {value!r}")
    if raw.get("connector") is not None:
        _choice(where, "connector", raw["connector"], CONNECTORS,
                "engine.{key} {value!r} is not supported (known: {known})")
    _choice(where, "scheduling_policy", raw.get("scheduling_policy", "fcfs"),
            SCHEDULING_POLICIES, "engine.{key} {value!r}: expected one of {known}")
    for key in ("connector_config", "kv_load_failure_policy", "mooncake_global_segment_size"):
        if key in raw and not raw.get("connector"):
            raise TraceError(where, f"engine.{key} needs engine.connector")
    if raw.get("kv_load_failure_policy") is not None:
        _choice(where, "kv_load_failure_policy", raw["kv_load_failure_policy"],
                KV_LOAD_FAILURE_POLICIES, "engine.{key} must be one of {known}, got {value!r}")
    config = raw.get("connector_config") or {}
    if raw.get("connector") == "offloading":
        _offloading_config(where, raw, config)
    reject_unknown_keys(where, "engine.connector_config", config,
                        CONNECTOR_CONFIG_KEYS.get(raw.get("connector"), ()))
    if "kv_role" in config:
        _choice(where, "connector_config.kv_role", config["kv_role"], KV_ROLES,
                "engine.{key} must be one of {known}, got {value!r}")
    if raw.get("prefill_instance") is not None:
        _prefill_instance(where, raw)
    if raw.get("tensor_parallel_size", 1) % raw.get("decode_context_parallel_size", 1):
        raise TraceError(where, "engine.tensor_parallel_size must be a multiple of "
                                "engine.decode_context_parallel_size")
    group_default = raw.get("block_size", DEFAULT_BLOCK_SIZE)
    given_groups, groups = _groups(where, raw.get("kv_groups", [{"kind": "full_attention"}]),
                                   group_default)
    spec = raw.get("speculative")
    given = {**copy.deepcopy(raw), "kv_groups": given_groups}
    values = {k: v for k, v in raw.items() if k not in ("kv_groups", "speculative")}
    if "prefix_cache_retention_interval" in raw and raw["prefix_cache_retention_interval"] is None:
        values["prefix_cache_retention_interval"] = RETAIN_DENSE
    if raw.get("hash_seed") is not None:
        values["hash_seed"] = str(raw["hash_seed"])
    values["connector_config"] = dict(raw.get("connector_config") or {})
    if raw.get("mooncake_global_segment_size") is not None:
        try:
            values["mooncake_global_segment_size"] = parse_size(
                raw["mooncake_global_segment_size"], "engine.mooncake_global_segment_size")
        except ValueError as exc:
            raise TraceError(where, str(exc)) from None
    attention = [g.block_size for g in groups if g.kind != "mamba"]
    values.setdefault("block_size", min(attention))
    if values.get("kda_prefill_backend") is not None and not any(
            g.kind == "mamba" for g in groups):
        raise TraceError(where, "engine.kda_prefill_backend needs a mamba group in "
                                "engine.kv_groups (the KDA layers it describes)")
    if values.get("mamba_prefill_checkpoint_alignment") is not None:
        _check_int(where, "mamba_prefill_checkpoint_alignment",
                   values["mamba_prefill_checkpoint_alignment"])
        if not any(g.kind == "mamba" for g in groups):
            raise TraceError(where, "engine.mamba_prefill_checkpoint_alignment needs a mamba "
                                    "group in engine.kv_groups (the layers that export)")
        if values.get("kda_prefill_backend") is not None:
            raise TraceError(where, "engine.mamba_prefill_checkpoint_alignment and "
                                    "engine.kda_prefill_backend both set the Mamba layers' "
                                    "prefill checkpoints: give one")
    speculative = None if spec is None else _speculative(where, spec, groups)
    return EngineBlock(kv_groups=groups, speculative=speculative, given=given, **values)
