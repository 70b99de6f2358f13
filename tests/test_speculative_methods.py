"""EAGLE/MTP as vLLM applies them (issue 14 items 3 and 9): which groups vLLM
drops from, and MTP with several draft tokens over one or several modules."""

from __future__ import annotations

import textwrap

import pytest

from conftest import SCENARIOS
from replayer.replay.execution.clients import replay_on as replay
from traces import load_target
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError


def hits(result):
    return {r.id: r.num_cached_tokens for r in result.requests}


def test_lookahead_hashes_mean_no_group_is_dropped_from():
    """vLLM flags the draft's group (is_eagle_group) but lookahead hashes clear the drop."""
    result = replay(load_target(SCENARIOS / "mtp_one_module_lookahead.yaml"))
    assert result.kv_groups == [{"group": 0, "kind": "full_attention", "eagle_drop": False}]
    assert hits(result)["a97_again"] == 96


def test_multi_module_mtp_drops_more_than_one_module():
    """Three MTP modules read three prefill tokens ahead: the drop reaches a block lower."""
    multi = replay(load_target(SCENARIOS / "mtp_multi_module_drop.yaml"))
    assert multi.kv_groups == [{"group": 0, "kind": "full_attention", "eagle_drop": True}]
    assert hits(multi) == {"a97": 0, "a97_again": 64, "b98": 0, "b98_again": 80,
                           "c110": 0, "c110_again": 80}


def test_no_group_holding_the_draft_means_vllm_drops_from_every_group(tmp_path):
    """A sliding-window-only model: no group holds the draft's layers, so vLLM
    flags every group (its fallback) and drops; is_eagle_group says false."""
    path = tmp_path / "swa_eagle.yaml"
    path.write_text(textwrap.dedent("""\
        engine:
          kv_groups: [{kind: sliding_window, sliding_window: 4096}]
          speculative: {method: eagle, num_speculative_tokens: 1,
                        disable_lookahead_block_hashes: true}
        requests:
          - {id: a, prompt: [{stream: a, len: 100}]}
          - {id: a_again, after: a, prompt: [{stream: a, len: 100}]}
        """))
    result = replay(load_target(path))
    assert result.kv_groups == [{"group": 0, "kind": "sliding_window", "eagle_drop": True}]
    assert hits(result)["a_again"] == 80


def test_mtp_modules_is_checked():
    block = EngineBlock.from_dict("s.yaml", {"speculative": {"method": "mtp",
                                                            "num_speculative_tokens": 3,
                                                            "mtp_modules": 3}})
    assert block.speculative.mtp_modules == 3
    with pytest.raises(TraceError, match="mtp_modules only applies to method mtp"):
        EngineBlock.from_dict("s.yaml", {"speculative": {"method": "eagle", "mtp_modules": 2}})
    with pytest.raises(TraceError, match="speculative.mtp_modules must be an integer >= 1"):
        EngineBlock.from_dict("s.yaml", {"speculative": {"method": "mtp", "mtp_modules": 0}})


def test_dspark_reserves_eight_lookahead_slots_and_drops_nothing(tmp_path):
    """vLLM 0.33, DSpark with 8 draft tokens: no EAGLE drop (x_again hits every
    whole block), and 8 lookahead slots (7 blocks a prefill, so y leaves x its
    first block). DFlash with 8 tokens reserves 9 (8 blocks): x_third misses;
    lookahead hashes off changes nothing for DSpark (it has no drop to clear)."""
    source = SCENARIOS / "dspark_lookahead.yaml"
    dspark = replay(load_target(source))
    assert dspark.kv_groups == [{"group": 0, "kind": "full_attention", "eagle_drop": False}]
    assert hits(dspark) == {"x": 0, "x_again": 96, "y": 0, "x_third": 16, "x_decode": 96}
    # 10 output tokens: one at the prefill, nine (8 accepted drafts) in one decode step.
    decode = next(r for r in dspark.requests if r.id == "x_decode")
    assert decode.finish_step == decode.prefill_step + 1

    text = source.read_text()
    engine = "speculative: {method: dspark, num_speculative_tokens: 8}"
    assert engine in text
    variants = {"dflash": "speculative: {method: dflash, num_speculative_tokens: 8}",
                "no_hashes": "speculative: {method: dspark, num_speculative_tokens: 8, "
                             "disable_lookahead_block_hashes: true}"}
    got = {}
    for name, line in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text.replace(engine, line))
        got[name] = hits(replay(load_target(path)))
    assert got["dflash"] == {"x": 0, "x_again": 96, "y": 0, "x_third": 0, "x_decode": 96}
    assert got["no_hashes"] == hits(dspark)


def test_dspark_draft_is_the_tiny_qwen3_dspark_config():
    from replayer.replay.engines.config.engine_config import draft_model

    block = EngineBlock.from_dict("s.yaml", {"speculative": {"method": "dspark",
                                                            "num_speculative_tokens": 8}})
    assert block.speculative.method == "dspark"
    assert draft_model("dspark").name == "tiny-dspark"
    assert draft_model("dspark", wide=True).name == "tiny-dspark-tp8"
    with pytest.raises(TraceError, match="mtp_modules only applies to method mtp"):
        EngineBlock.from_dict("s.yaml", {"speculative": {"method": "dspark", "mtp_modules": 2}})


def test_a_draft_path_naming_another_method_is_refused_not_replayed_wrong(tmp_path, monkeypatch):
    """vLLM reads an MTP draft's method from words in its path first: under a
    folder named dspark the tiny MTP draft would replay as DSpark (no drop)."""
    import shutil

    from replayer.replay.engines import EngineError
    from replayer.replay.engines.config import engine_config
    from replayer.replay.engines.vllm_0_33 import build_vllm_config

    draft = tmp_path / "dspark-checkout" / "tiny-mtp"
    shutil.copytree(engine_config.MTP_DRAFT_MODEL, draft)
    monkeypatch.setattr(engine_config, "MTP_DRAFT_MODEL", draft)
    engine = load_target(SCENARIOS / "mtp_multi_module_drop.yaml").engine.sized_for(120)
    with pytest.raises(EngineError, match=r"method mtp: cannot build this engine here: vLLM "
                                          r"took the draft .*tiny-mtp for method dspark"):
        build_vllm_config(engine)
