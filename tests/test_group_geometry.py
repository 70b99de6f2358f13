"""Geometry vLLM's own tests use that a scenario can now say (issue 14 items 5 and 6):
which group holds the EAGLE/MTP draft, chunked local attention, MLA beside other
kinds, and Mamba cache mode 'all' (0.29-0.31 only, refused by newer releases)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import FIXTURES, SCENARIOS, cli
from helpers_traces import assert_bad_input
from replayer.replay.engines import UnsupportedByEngine, check_supported
from replayer.recorder.header import _draft_group
from replayer.replay.execution.clients import replay_on as replay
from traces import load_target
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError

DRAFT_GROUP = SCENARIOS / "eagle_draft_group.yaml"
CHUNKED = SCENARIOS / "chunked_local_attention.yaml"
MAMBA_ALL = FIXTURES / "releases" / "mamba_cache_mode_all.yaml"


def hits(result):
    return {r.id: r.num_cached_tokens for r in result.requests}


def variant(tmp_path, source, old, new, name="variant.yaml"):
    text = source.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return load_target(path)


def test_draft_group_decides_which_group_vllm_drops_from(tmp_path):
    """The draft in the window group drops a 16-token block there; in the
    full-attention group (the default) it drops elsewhere and hits more."""
    in_window = replay(load_target(DRAFT_GROUP))
    assert in_window.kv_groups == [
        {"group": 0, "kind": "full_attention", "eagle_drop": False},
        {"group": 1, "kind": "sliding_window", "eagle_drop": True}]
    assert hits(in_window) == {"b97": 0, "b97_again": 32, "f64": 0, "f64_again": 0,
                               "g129": 0, "g129_again": 64}
    default = replay(variant(tmp_path, DRAFT_GROUP, ", draft_group: 1}", "}"))
    assert default.kv_groups == [
        {"group": 0, "kind": "full_attention", "eagle_drop": True},
        {"group": 1, "kind": "sliding_window", "eagle_drop": False}]
    assert hits(default) == {"b97": 0, "b97_again": 64, "f64": 0, "f64_again": 32,
                             "g129": 0, "g129_again": 96}
    named = replay(variant(tmp_path, DRAFT_GROUP, "draft_group: 1", "draft_group: 0"))
    assert hits(named) == hits(default)


@pytest.mark.parametrize("speculative, message", [
    ({"method": "eagle", "draft_group": 2}, r"draft_group must index engine.kv_groups \(0 to 1\)"),
    ({"method": "eagle", "draft_group": True}, "draft_group must index engine.kv_groups"),
    ({"method": "eagle", "draft_group": 1}, "draft_group 1 is a mamba group"),
])
def test_draft_group_is_checked(speculative, message):
    with pytest.raises(TraceError, match=message) as err:
        EngineBlock.from_dict("s.yaml", {"kv_groups": ["full_attention", "mamba"],
                                         "speculative": speculative})
    assert str(err.value).startswith("s.yaml: ")


def test_no_eagle_drop_reaches_chunked_local_attention():
    """vLLM asserts the drop never reaches a chunked-local group: refused up front."""
    chunked = {"kind": "chunked_local", "attention_chunk_size": 64}
    with pytest.raises(TraceError, match="draft_group 1 is a chunked_local group"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": ["full_attention", chunked],
                                         "speculative": {"method": "eagle", "draft_group": 1}})
    with pytest.raises(TraceError, match="needs a group for the draft"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": [chunked],
                                         "speculative": {"method": "eagle"}})
    EngineBlock.from_dict("s.yaml", {"kv_groups": ["full_attention", chunked],
                                     "speculative": {"method": "eagle"}})


def test_a_bad_draft_group_in_a_scenario_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(DRAFT_GROUP.read_text().replace("draft_group: 1", "draft_group: 5"))
    assert_bad_input(cli("run", path), str(path), "engine.speculative.draft_group")


def test_chunked_local_needs_its_chunk_size_and_nothing_else_takes_one():
    block = EngineBlock.from_dict("s.yaml", {"kv_groups": [
        {"kind": "chunked_local", "attention_chunk_size": 64}]})
    assert block.kv_groups[0].attention_chunk_size == 64
    with pytest.raises(TraceError, match=r"kv_groups\[0\].attention_chunk_size must be"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": [{"kind": "chunked_local"}]})
    with pytest.raises(TraceError, match="attention_chunk_size only applies to kind "
                                         "chunked_local"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": [
            {"kind": "full_attention", "attention_chunk_size": 64}]})


def test_chunked_local_skips_whole_chunks_where_full_attention_misses(tmp_path):
    """vLLM counts the blocks before the last chunk as computed (null blocks)."""
    local = replay(load_target(CHUNKED))
    assert local.kv_groups == [{"group": 0, "kind": "chunked_local", "eagle_drop": False}]
    assert hits(local) == {"doc": 448, "filler": 256, "doc_again": 496, "doc_head": 64}
    full = replay(variant(
        tmp_path, CHUNKED, "{kind: chunked_local, attention_chunk_size: 64}\n"
        "  max_num_batched_tokens: 64\n  max_num_seqs: 4\n  num_gpu_blocks: 24",
        "{kind: full_attention}\n  max_num_batched_tokens: 64\n  max_num_seqs: 4\n"
        "  num_gpu_blocks: 40"))
    assert hits(full) == {"doc": 0, "filler": 0, "doc_again": 320, "doc_head": 96}


def test_mla_beside_other_kinds_caches_as_full_attention(tmp_path):
    """MLA is accepted beside a window and a Mamba group, and hits as full attention would."""
    path = SCENARIOS / "mla_hybrid.yaml"
    mla = replay(load_target(path))
    assert [g["kind"] for g in mla.kv_groups] == ["mla", "sliding_window", "mamba"]
    assert hits(mla) == {"doc": 0, "doc_again": 960, "doc_head": 0}
    full = replay(variant(tmp_path, path, "{kind: mla}", "{kind: full_attention}"))
    assert hits(full) == hits(mla)


def test_mamba_cache_mode_all_is_refused_where_vllm_removed_it():
    engine = load_target(MAMBA_ALL).engine
    assert engine.mamba_cache_mode == "all"
    for version in ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.1", "0.31.0"):
        check_supported(version, engine, "e")
    for version in ("0.32.0", "0.33.0"):
        with pytest.raises(UnsupportedByEngine, match=f"not in vLLM {version}"):
            check_supported(version, engine, "e")
    line = assert_bad_input(cli("run", MAMBA_ALL), "engine.mamba_cache_mode 'all'")
    assert "replays on 0.26.x, 0.27.x, 0.28.x, 0.29.x, 0.30.x, 0.31.x" in line
    proc = cli("check", "fixtures/releases")         # no "no goldens": refused, so skipped
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("SKIP fixtures/releases/mamba_cache_mode_all.yaml: vllm "
                                  "0.33.0 (installed): engine.mamba_cache_mode 'all' is not in")


@pytest.mark.slow
def test_mamba_cache_mode_all_keeps_every_block_state_on_0310(tmp_path):
    """'all' hits a mid-document prefix that 'align' cannot (one replay each on 0.31.0)."""
    from replayer.replay.execution.clients import engine_runner

    align = variant(tmp_path, MAMBA_ALL, "mamba_cache_mode: all", "mamba_cache_mode: align")
    with engine_runner("vllm==0.31.0") as run:
        on_all, on_align = run(load_target(MAMBA_ALL)), run(align)
    assert hits(on_all) == {"doc": 0, "doc_again": 288, "doc_head": 144}
    assert hits(on_align) == {"doc": 0, "doc_again": 288, "doc_head": 0}


def test_recorded_draft_group_is_the_one_group_vllm_marked():
    groups = [{"kind": "full_attention"}, {"kind": "sliding_window"}]
    assert _draft_group(groups, [1]) == 1
    assert _draft_group(groups, [0]) is None          # the default: not written
    assert _draft_group(groups, [0, 1]) is None       # every group flagged: nothing to say
    assert _draft_group(groups, []) is None


def test_dflash_builds_its_draft_kv_without_the_eagle_drop():
    """vLLM 0.33: DFlash/DSpark need no trailing-block drop (needs_eagle_block_drop)."""
    result = replay(load_target(SCENARIOS / "dflash_no_drop.yaml"))
    assert result.kv_groups == [{"group": 0, "kind": "full_attention", "eagle_drop": False}]
    assert hits(result) == {"a97": 0, "a97_again": 96, "b98": 0, "b98_again": 96,
                            "c110": 0, "c110_again": 96}


SPARSE = """
engine:
  block_size: 64
  kv_groups:
    - {kind: sliding_window, sliding_window: 256}
    - {kind: mamba}
  mamba_prefill_checkpoint_alignment: 1
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 128
requests:
  - {id: doc, prompt: [{stream: doc, len: 1000}]}
  - {id: doc_again, after: doc, prompt: [{stream: doc, len: 1000}, {stream: q, len: 40}]}
"""


def test_mamba2_prefill_checkpoints_end_a_prompt_in_one_chunk(tmp_path):
    """engine.mamba_prefill_checkpoint_alignment (Mamba2's MambaSpec export): the
    state at 960 is written inside the prompt's last chunk, so vLLM need not end a
    chunk there; without it the 1000-token prompt takes a step more. Same hits."""
    path = tmp_path / "sparse.yaml"
    path.write_text(SPARSE)
    exported = replay(load_target(path))
    path.write_text(SPARSE.replace("  mamba_prefill_checkpoint_alignment: 1\n", ""))
    split = replay(load_target(path))
    assert hits(exported) == hits(split) == {"doc": 0, "doc_again": 960}
    finish = {r.id: r.finish_step for r in exported.requests}
    assert {r.id: r.finish_step for r in split.requests} == {
        "doc": finish["doc"] + 1, "doc_again": finish["doc_again"] + 2}
    with pytest.raises(TraceError, match="mamba_prefill_checkpoint_alignment needs a mamba"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": ["full_attention"],
                                         "mamba_prefill_checkpoint_alignment": 1})
    with pytest.raises(TraceError, match="both set the Mamba layers' prefill checkpoints"):
        EngineBlock.from_dict("s.yaml", {"kv_groups": ["full_attention", "mamba"],
                                         "mamba_prefill_checkpoint_alignment": 1,
                                         "kda_prefill_backend": "triton"})


def test_the_recorder_writes_the_mamba_layers_prefill_checkpoints(tmp_path):
    """A recording's header says what the built Mamba specs export (Mamba2's
    alignment 1), and nothing where they export none."""
    from types import SimpleNamespace

    from replayer.recorder import vllm_0_33 as recorder_adapter
    from replayer.recorder.header import engine_block
    from replayer.replay.engines.vllm_0_33 import build_vllm_config, layer_specs

    path = tmp_path / "sparse.yaml"
    for text, wanted in ((SPARSE, 1), (SPARSE.replace(
            "  mamba_prefill_checkpoint_alignment: 1\n", ""), None)):
        path.write_text(text)
        engine = load_target(path).sized_engine()
        groups = [SimpleNamespace(kv_cache_spec=spec) for spec in layer_specs(engine).values()]
        built = SimpleNamespace(kv_cache_groups=groups, num_blocks=engine.num_gpu_blocks)
        block = engine_block(build_vllm_config(engine), built, recorder_adapter)
        assert block.mamba_prefill_checkpoint_alignment == wanted
        assert [g.kind for g in block.kv_groups] == ["sliding_window", "mamba"]


@pytest.mark.parametrize("backend", ["flashkda", "triton"])
def test_the_recorder_says_kda_layers_by_their_backend(tmp_path, monkeypatch, backend):
    """Kimi's KDA layers under FlashKDA export prefill checkpoints as Mamba2's do
    (``num_prefill_checkpoint_blocks``, alignment 16), but a trace says KDA by
    ``kda_prefill_backend``, whose alignment each release gives (0.29's spec has
    none): the recorded header names the backend, never the alignment."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from replayer.recorder import vllm_0_33 as recorder_adapter
    from replayer.recorder.header import engine_block
    from replayer.replay.engines.vllm_0_33 import build_vllm_config, layer_specs

    path = tmp_path / "kda.yaml"
    path.write_text(SPARSE.replace("mamba_prefill_checkpoint_alignment: 1",
                                   f"kda_prefill_backend: {backend}"))
    engine = load_target(path).sized_engine()
    specs = [s for s in layer_specs(engine).values() if type(s).__name__ == "MambaSpec"]
    assert {s.num_prefill_checkpoint_blocks for s in specs} == {int(backend == "flashkda")}
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in layer_specs(engine).values()]
    built = SimpleNamespace(kv_cache_groups=groups, num_blocks=engine.num_gpu_blocks)
    config = build_vllm_config(engine)
    monkeypatch.setattr(ModelConfig, "architectures",
                        property(lambda self: ["KimiK3ForConditionalGeneration"]))
    block = engine_block(config, built, recorder_adapter)
    assert block.kda_prefill_backend == backend
    assert block.mamba_prefill_checkpoint_alignment is None
