"""TP/DCP as the scheduler sees them (issue 14 item 2): DCP scales vLLM's
scheduler block, so hits align to block_size * decode_context_parallel_size."""

from __future__ import annotations

import textwrap

import pytest

from replayer.replay.execution.clients import replay_on as replay
from traces import load_target
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError


def test_dcp_must_divide_tp():
    block = EngineBlock.from_dict("s.yaml", {"tensor_parallel_size": 4,
                                             "decode_context_parallel_size": 2})
    assert (block.tensor_parallel_size, block.decode_context_parallel_size) == (4, 2)
    with pytest.raises(TraceError, match="tensor_parallel_size must be a multiple of"):
        EngineBlock.from_dict("s.yaml", {"decode_context_parallel_size": 2})


def test_dcp_scales_the_hit_alignment(tmp_path):
    """A 90-token resend hits 80 on 16-token blocks, 64 on DCP 2's 32-token scheduler block."""
    path = tmp_path / "dcp.yaml"
    path.write_text(textwrap.dedent("""\
        engine: {block_size: 16, tensor_parallel_size: 2, decode_context_parallel_size: 2}
        requests:
          - {id: a, prompt: [{stream: a, len: 90}]}
          - {id: a_again, after: a, prompt: [{stream: a, len: 90}]}
        """))
    result = replay(load_target(path))
    assert {r.id: r.num_cached_tokens for r in result.requests} == {"a": 0, "a_again": 64}
