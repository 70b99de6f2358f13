"""Anonymising keeps every hit, EAGLE lookahead hashes included (installed vLLM)."""

from __future__ import annotations

import textwrap

from traces import load_target

# Block 16, EAGLE with vLLM 0.33's lookahead hashes: each block's hash also
# covers the next token. ``b`` shares 97 tokens with ``a``: six blocks and the
# token after them, then differs inside the seventh block. So ``b`` hits all
# six blocks only if the anonymised tokens keep that lookahead token equal too.
SCENARIO = """\
engine:
  block_size: 16
  kv_groups: [{kind: full_attention}]
  speculative: {method: eagle, num_speculative_tokens: 1}
  max_num_batched_tokens: 2048
  max_num_seqs: 8
  num_gpu_blocks: 256
requests:
  - id: a
    prompt: [{stream: s, start: 0, len: 100}]
    output_len: 1
  - id: b
    after: a
    prompt: [{stream: s, start: 0, len: 97}, {stream: t, start: 0, len: 40}]
    output_len: 1
  - id: c
    after: b
    prompt: [{stream: s, start: 0, len: 96}, {stream: u, start: 0, len: 40}]
    output_len: 1
"""


def _hits(trace) -> dict[str, int]:
    from replayer.replay.execution.clients import replay_on

    return {r.id: r.num_cached_tokens for r in replay_on(trace).requests}


def test_anonymised_trace_keeps_hits_that_hinge_on_the_lookahead_token(tmp_path):
    from replayer.analysis.anonymize import anonymize, default_unit

    path = tmp_path / "lookahead.yaml"
    path.write_text(textwrap.dedent(SCENARIO))
    trace = load_target(path)
    assert default_unit(trace.engine) == 1          # chunks must end after the lookahead token
    original = _hits(trace)
    # The case is not vacuous: the shared lookahead token is what lets b hit
    # six blocks where c, which differs right after the sixth block, hits five.
    assert original == {"a": 0, "b": 96, "c": 80}
    assert _hits(anonymize(trace, secret=b"k")) == original


def test_unit_stays_the_block_when_no_hash_looks_ahead(tmp_path):
    from replayer.analysis.anonymize import default_unit
    from traces.model.engine_spec import EngineBlock

    def unit(**settings) -> int:
        return default_unit(EngineBlock.from_dict("test", {
            "block_size": 16, "kv_groups": [{"kind": "full_attention"}], **settings}))

    eagle = {"method": "eagle", "num_speculative_tokens": 1}
    assert unit(speculative={**eagle, "disable_lookahead_block_hashes": True}) == 16
    assert unit(speculative=eagle, connector="mooncake_store") == 16
    assert unit() == 16
