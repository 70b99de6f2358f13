"""Adapter for vLLM 0.26.x to 0.32.x: the real EngineCore over a null model.

These releases run EngineCore, the Executor base and the output dataclasses
exactly as the replay uses them in 0.33, so the driver is the shared
:mod:`.core_driver` (the real ``EngineCore`` works on all seven; no release
needs the scheduler assembled by hand). What differs from 0.33, found by
reading each wheel's ``vllm/v1/core``, ``v1/engine/core.py``,
``v1/executor/abstract.py``, ``v1/kv_cache_interface.py`` and
``config/*.py``, is all here:

* **0.26-0.28 read the retention interval from the environment**
  (``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, read by the KV-cache coordinator
  when the scheduler is built; unset means dense, where 0.29's
  ``CacheConfig.prefix_cache_retention_interval`` defaults to 0): the trace's
  value is set there while the engine is built (:func:`_release_environment`),
  and unset when the trace leaves it out, whatever the caller's environment says.
* **0.26-0.28 have no FlashKDA prefill checkpoints** on ``MambaSpec``: a
  trace naming ``kda_prefill_backend`` is refused there.
* **0.26-0.28's MooncakeStore lookup answers a bare hit count** (no tail-key
  boundaries: ``protocol.py`` and ``LookupKeyClient`` differ from 0.29's), so
  no store adapter serves them and a connector trace is refused in one line
  (``check_connector``).

* **KV-cache specs have no ``is_draft``** (0.33 added it). Each release finds
  the drafter's group its own way (``_annotate_eagle_groups`` in
  ``v1/core/kv_cache_utils.py``): Kimi-K3 DSpark's MLA marker
  (``non_causal_multi_token_decode``, 0.29 on); the group holding the last
  registered layer, for DeepSeek-V4 (0.26 on) and, from 0.31, for any MTP
  drafter. An EAGLE drafter on a model of neither kind is found by none of
  them, so vLLM flags every KV-cache group as an EAGLE group (its own fallback;
  0.31 and 0.32 log "no KV cache group could be identified as the draft
  model's"). That is what production ran: the draft layer still joins the
  first attention group, and the Mamba group is dropped from too. The null
  executor lists the draft's layer last, as a real drafter registers
  (``plan_layers``), so an MTP trace on 0.31 and 0.32 gets the group its draft
  layer joined (``fixtures/scenarios/mtp_draft_group.yaml``).
* **No lookahead block hashes.** ``SpeculativeConfig`` has no
  ``disable_lookahead_block_hashes`` (0.33 added the hashes and the flag), so
  with EAGLE the trailing block is always dropped (0.30-0.32 have
  ``disable_eagle_block_drop``, default off, which no trace sets). A trace that
  asks for lookahead hashes (the 0.33 default) replays with the drop, and a
  note says so.
* **``CacheConfig.enable_mamba_shared_prefix_checkpoint``** is 0.31's name;
  0.30 has the same flag as ``enable_mamba_fine_grained_prefix_cache`` (same
  docstring, same use in its KV-cache manager), passed under that name; 0.29
  has none, so a trace that turns it on is refused there unless
  ``--allow-missing`` names it (:func:`release_settings`).
* ``Executor.set_kv_cache_layout`` sends only the layout (0.33 adds the
  context-parallel interleave size); the null executor takes either.
* **Connector replay** runs on all four through the store adapter
  ``STORE_ADAPTERS`` names (:mod:`.mooncake_0_33`: its seams are the same from
  0.29 on). What the connector does differs, and is vLLM's own (seen on
  ``fixtures/store/resend_after_reset.yaml``): 0.29 puts a prompt tail's
  attention KV and Mamba state both at B + H, and no block-aligned Mamba
  state; 0.30 and 0.31 (``_sub_block_tail_puts``) put both at B, the layout
  #56615 fixed; 0.32 puts Mamba at B and attention at B + H, as 0.33 does.
* **``mamba_cache_mode: all``** (every block's Mamba state cached) exists on
  0.29-0.31 only; 0.32 refuses it (``check_supported`` in ``__init__``).
* **Kimi KDA layers** (``kda_prefill_backend``): each release's
  ``KimiK3DeltaAttention.get_kv_cache_spec`` marks FlashKDA's internal prefill
  checkpoints on its MambaSpec in its own way (:func:`kda_checkpoint_fields`);
  what the scheduler and managers then do with them is vLLM's own, and differs
  (0.29 exports the state at the last block boundary inside a chunk that ends
  mid-block; 0.30 and 0.31 at the hash-unit boundary ``(n - 1) // H * H`` of
  the chunk's end n, less H under EAGLE; 0.32 from ``n`` itself).
* **``speculative.draft_group``** needs ``is_draft`` for EAGLE: every group is
  an EAGLE group whichever group the draft layer joins (a note says so); an
  MTP draft's group is found by position on 0.31 and 0.32 (no note there).

Under the sources of 0.29.0 the #51295 pair shows the production miss as
upstream reported it (turn 2 hits 23040 after a 24576-token turn 1, and 0
after 24577); 0.30.0 and later hit 24448.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

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

from replayer.replay.engines import check_connector, store_adapter
from replayer.replay.engines.base import UnsupportedByEngine
from replayer.replay.engines.core_driver import CoreEngine, NullExecutor
from replayer.replay.engines.config.engine_config import (
    SETTINGS,
    Env,
    LayerPlan,
    Lacking,
    Mapping,
    Named,
    build_config,
    declared_checkpoint_fields,
    cache_kwargs,
    given_value,
    plan_layers,
    refuse_dropped,
    release_environment,
)
from traces.model.engine_spec import EngineBlock

VERSIONS = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32")  # the range served
DTYPE = torch.float16

NO_LOOKAHEAD = Lacking(True, "no lookahead block hashes: with EAGLE the trailing block is "
                             "always dropped; disable_lookahead_block_hashes is 0.33's")
# Each release's own spelling of the settings it has under another name, and
# the ones it lacks (read from each wheel's vllm/config/*.py; tests/
# test_settings_per_release.py checks every name against those sources).
NO_SHARED_PREFIX_CHECKPOINT = Lacking(
    False, "no Mamba checkpoint at a shared-prefix junction; the flag came in 0.30 as "
           "enable_mamba_fine_grained_prefix_cache")
RETENTION_FROM_ENV = Env("VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
BEFORE_0_29: Mapping = {"prefix_cache_retention_interval": RETENTION_FROM_ENV,
                        "enable_mamba_shared_prefix_checkpoint": NO_SHARED_PREFIX_CHECKPOINT,
                        "speculative.disable_lookahead_block_hashes": NO_LOOKAHEAD}
RELEASE_SETTINGS: dict[str, Mapping] = {
    "0.26": BEFORE_0_29,
    "0.27": BEFORE_0_29,
    "0.28": BEFORE_0_29,
    "0.29": {"enable_mamba_shared_prefix_checkpoint": NO_SHARED_PREFIX_CHECKPOINT,
             "speculative.disable_lookahead_block_hashes": NO_LOOKAHEAD},
    "0.30": {"enable_mamba_shared_prefix_checkpoint": Named(
                 "CacheConfig", "enable_mamba_fine_grained_prefix_cache"),
             "speculative.disable_lookahead_block_hashes": NO_LOOKAHEAD},
    "0.31": {"speculative.disable_lookahead_block_hashes": NO_LOOKAHEAD},
    "0.32": {"speculative.disable_lookahead_block_hashes": NO_LOOKAHEAD},
}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def release_settings(version: str) -> Mapping:
    """Every scenario setting under release ``version``'s own name, or :class:`Lacking`."""
    major, minor = _minor(version)
    return {**SETTINGS, **RELEASE_SETTINGS[f"{major}.{minor}"]}


@contextmanager
def _release_environment(engine: EngineBlock, version: str) -> Iterator[None]:
    """The settings release ``version`` reads from environment variables
    (:class:`Env` entries: 0.26-0.28's retention interval), set while vLLM builds
    the engine, then put back. vLLM may cache its environment (``envs.
    enable_envs_cache``, which EngineCore turns on): that cache is cleared both ways."""
    values = release_environment(engine, release_settings(version))
    if not values:
        yield
        return
    import vllm.envs as envs

    saved = {name: os.environ.get(name) for name in values}

    def put(pairs: dict[str, str | None]) -> None:
        for name, value in pairs.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear = getattr(envs.__getattr__, "cache_clear", None)
        if clear is not None:
            clear()

    put(values)
    try:
        yield
    finally:
        put(saved)


def kv_spec(plan: LayerPlan, engine: EngineBlock) -> KVCacheSpec:
    """A layer's spec with these releases' constructors (no ``is_draft``)."""
    if plan.kind == "mamba":
        return MambaSpec(block_size=plan.block_size, shapes=((4,),), dtypes=(DTYPE,),
                         page_size_padded=plan.page_bytes,
                         mamba_cache_mode=engine.mamba_cache_mode,
                         num_speculative_blocks=engine.num_speculative_tokens,
                         **kda_checkpoint_fields(engine))
    if plan.kind == "sliding_window":
        return SlidingWindowSpec(block_size=plan.block_size, num_kv_heads=1,
                                 head_size=plan.head_size, dtype=DTYPE,
                                 sliding_window=int(plan.sliding_window or 0))
    if plan.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                         head_size=plan.head_size, dtype=DTYPE,
                                         attention_chunk_size=int(plan.attention_chunk_size or 0))
    if plan.kind == "mla":
        return MLAAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                                head_size=2 * plan.head_size, dtype=DTYPE)
    return FullAttentionSpec(block_size=plan.block_size, num_kv_heads=1,
                             head_size=plan.head_size, dtype=DTYPE)


# 0.30's KimiK3DeltaAttention.get_kv_cache_spec sets this alignment inline
# (``16 if self.kda_prefill_backend == "flashkda" else None``); 0.31 and 0.32 name
# it kda_prefill_checkpoint_alignment. tests/test_kimi_k3.py reads each release.
FLASHKDA_CHECKPOINT_ALIGNMENT_0_30 = 16


def kda_checkpoint_fields(engine: EngineBlock) -> dict[str, Any]:
    """What this release's Kimi KDA layer adds to its MambaSpec for
    ``engine.kda_prefill_backend`` (``KimiK3DeltaAttention.get_kv_cache_spec``):
    0.29 only ``num_prefill_checkpoint_blocks`` (its spec has no alignment);
    0.30 the inline alignment; 0.31 and 0.32 vLLM's own function. With
    ``engine.mamba_prefill_checkpoint_alignment`` (0.30 and later), that alignment."""
    declared = declared_checkpoint_fields(engine)
    if declared is not None:
        return declared
    backend = engine.kda_prefill_backend
    if backend is None:
        return {}
    from dataclasses import fields

    flashkda = backend == "flashkda"
    names = {f.name for f in fields(MambaSpec)}
    if "prefill_checkpoint_alignment" not in names:
        return {"num_prefill_checkpoint_blocks": int(flashkda)}        # 0.29
    try:
        from vllm.model_executor.layers.mamba.kda_checkpoint import (
            kda_prefill_checkpoint_alignment,
        )
    except ImportError:                                                 # 0.30
        alignment = FLASHKDA_CHECKPOINT_ALIGNMENT_0_30 if flashkda else None
    else:
        alignment = kda_prefill_checkpoint_alignment(backend)
    return {"num_prefill_checkpoint_blocks": int(alignment is not None),
            "prefill_checkpoint_alignment": alignment}


def layer_specs(engine: EngineBlock) -> dict[str, KVCacheSpec]:
    return {p.name: kv_spec(p, engine) for p in plan_layers(engine, DTYPE.itemsize)}


def finds_mtp_group(engine: EngineBlock, version: str) -> bool:
    """Whether release ``version`` finds this trace's draft group itself: from
    0.31 an MTP drafter's group is the one holding the last registered layer
    (``_uses_trailing_mtp_layers``), which the null executor lists last."""
    spec = engine.speculative
    return spec is not None and spec.method == "mtp" and _minor(version) >= (0, 31)


def missing_settings(engine: EngineBlock, version: str, dropped: list[str]) -> list[str]:
    """One note per trace setting release ``version`` runs otherwise than 0.33:
    the ones ``--allow-missing`` let it drop, vLLM 0.33's defaults it lacks,
    and ``draft_group`` (a layer's place, which every release honours, but
    without ``is_draft`` vLLM flags every group)."""
    notes = [f"vLLM {version} has no engine.{key}: replayed without it (--allow-missing; "
             "the --json engine block lists it under dropped)" for key in dropped]
    spec = engine.speculative
    if spec is not None and not spec.disable_lookahead_block_hashes and not given_value(
            engine, "speculative.disable_lookahead_block_hashes")[0]:
        notes.append(f"vLLM {version} has no lookahead block hashes: replayed with the EAGLE "
                     "drop on (engine.speculative.disable_lookahead_block_hashes is 0.33's)")
    if spec is not None and spec.draft_group is not None and not finds_mtp_group(
            engine, version):
        notes.append(f"vLLM {version} has no is_draft: every KV-cache group is an EAGLE "
                     "group, so engine.speculative.draft_group only places the draft layer "
                     "(it is 0.33's)")
    return notes


def build_vllm_config(engine: EngineBlock, version: str,
                      executor: type[NullExecutor] = NullExecutor,
                      kv_events: bool = False, worker: Any = None) -> VllmConfig:
    """The shared config under this release's names (:func:`release_settings`: no
    ``disable_lookahead_block_hashes`` before 0.33, the shared-prefix checkpoint
    flag under 0.30's name, none in 0.29); plus the store connector
    (``executor`` is then the store adapter's store-aware one)."""
    cache_args = cache_kwargs(engine, release_settings(version))
    kv_transfer = None
    if engine.connector:
        store = store_adapter(version, engine.connector, f"vllm {version}")
        kv_transfer = store.kv_transfer_config(engine)
    return build_config(engine, executor, cache_args=cache_args, kv_transfer=kv_transfer,
                        kv_events=kv_events, worker=worker)


def open_engine(engine: EngineBlock, version: str, store: Any = None,
                recorder: Any = None, kv_events: bool = False,
                worker: str = "null") -> CoreEngine:
    check_connector(version, engine.connector, f"vllm {version}")
    dropped = refuse_dropped(engine, release_settings(version), version)
    if engine.kda_prefill_backend is not None and _minor(version) < (0, 29):
        raise UnsupportedByEngine(f"vllm {version}: engine.kda_prefill_backend: this "
                                  "release's MambaSpec has no prefill checkpoints (FlashKDA's "
                                  "came in 0.29)")
    if engine.mamba_prefill_checkpoint_alignment is not None and _minor(version) < (0, 30):
        raise UnsupportedByEngine(f"vllm {version}: engine.mamba_prefill_checkpoint_alignment: "
                                  "this release's MambaSpec has no prefill_checkpoint_alignment "
                                  "(0.30 added it)")
    if engine.speculative and any(g.kind == "chunked_local" for g in engine.kv_groups):
        # No is_draft: every group is an EAGLE group, and vLLM's chunked-local
        # lookup asserts the drop never reaches it.
        raise UnsupportedByEngine(f"vllm {version}: EAGLE/MTP beside a chunked_local group "
                                  "is not replayable on this release (no is_draft, so vLLM "
                                  "drops from every group, and it does not support the drop "
                                  "on chunked local attention)")
    executor = NullExecutor
    if engine.connector:
        executor = store_adapter(version, engine.connector, f"vllm {version}").StoreAwareExecutor
    if worker == "model":
        # vLLM's own executor, worker and model runner (replayer.replay.engines.worker):
        # one rank in this process, or one process per rank at TP N; with a
        # connector, the store's seams around the one vLLM's worker creates.
        from replayer.replay.engines.worker.executor import model_core
        from replayer.replay.engines.worker.ranks import executor_class

        executor = executor_class(engine)

    def core_for(config: VllmConfig) -> CoreEngine:
        if engine.connector:
            store_engine = store_adapter(version, engine.connector,
                                         f"vllm {version}").StoreConnectorEngine
            return store_engine(config, layer_specs(engine), version, engine, store,
                                executor_cls=executor)
        return CoreEngine(config, layer_specs(engine), version, executor_cls=executor)

    with _release_environment(engine, version):
        if worker == "model":
            core = model_core(
                engine, version,
                lambda args: build_vllm_config(engine, version, executor, kv_events, worker=args),
                core_for, recorder)
        else:
            config = build_vllm_config(engine, version, executor, kv_events)
            if recorder is not None:        # the caller's hooks (see replay.engines.open_engine)
                recorder(config, version, bool(engine.connector))
            core = core_for(config)
    core.notes = missing_settings(engine, version, dropped)
    core.dropped = tuple(dropped)
    return core
