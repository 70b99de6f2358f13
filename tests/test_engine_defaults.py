"""Defaults vLLM accepts (issue 14 item 10): what sized_for chooses, no vLLM needed,
and a scenario that vLLM's own defaults would have refused, replayed."""

from __future__ import annotations

import textwrap

from conftest import cli
from traces.model.engine_spec import EngineBlock


def sized(longest: int, **engine) -> EngineBlock:
    return EngineBlock.from_dict("test", engine).sized_for(longest)


def test_max_num_seqs_follows_a_small_token_budget():
    block = sized(40, max_num_batched_tokens=64)
    assert block.max_num_seqs == 64 and block.max_num_batched_tokens == 64
    assert block.chosen == ("engine.max_num_seqs left out: 64 chosen (vLLM's default 128 "
                            "exceeds max_num_batched_tokens 64, which vLLM refuses)",)


def test_given_budgets_and_vllm_defaults_that_start_are_left_alone():
    assert sized(40, max_num_batched_tokens=64, max_num_seqs=8).max_num_seqs == 8
    plain = sized(40)
    assert plain.max_num_seqs is None and plain.max_num_batched_tokens is None
    assert plain.chosen == ()
    assert sized(40, max_num_batched_tokens=4096).max_num_seqs is None


def test_token_budget_covers_many_sequences_and_unchunked_prefill():
    block = sized(40, max_num_seqs=3000)
    assert block.max_num_batched_tokens == 3000 and len(block.chosen) == 1
    unchunked = sized(4000, enable_chunked_prefill=False)
    assert unchunked.max_model_len == 4016
    assert unchunked.max_num_batched_tokens == 4016
    assert "chunked prefill being off" in unchunked.chosen[0]
    assert sized(1000, enable_chunked_prefill=False).max_num_batched_tokens is None


def test_max_model_len_is_not_rounded_past_a_given_pool():
    groups = [{"kind": "full_attention"},
              {"kind": "sliding_window", "sliding_window": 64, "block_size": 64}]
    assert sized(100, kv_groups=groups).max_model_len == 128
    assert sized(100, kv_groups=groups, num_gpu_blocks=11).max_model_len == 101
    assert sized(100, long_prefill_token_threshold=300).max_model_len == 304


def test_small_scenario_vllm_defaults_would_refuse_replays_and_says_why(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {max_num_batched_tokens: 64}
        requests:
          - {id: a, prompt: [{stream: a, len: 40}]}
          - {id: b, after: a, prompt: [{stream: a, len: 40}]}
        """))
    proc = cli("run", path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("replayer: note: engine.max_num_seqs left out: 64 chosen (vLLM's "
                           "default 128 exceeds max_num_batched_tokens 64, which vLLM "
                           "refuses)\n")
    assert "b            40      32" in proc.stdout
