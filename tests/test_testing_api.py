"""replayer.pytest.testing: typed outcomes for a user's own tests (function and pytest fixture)."""

from __future__ import annotations

import pytest

from helpers_traces import REPO
from test_pytest_plugin import run_pytest

PAIR = REPO / "fixtures" / "scenarios" / "vllm51295_turn1_24577.yaml"


def test_replay_returns_typed_outcomes_by_id():
    from replayer.pytest.testing import replay

    result = replay(PAIR)
    assert list(result) == ["turn1", "turn2"]
    assert result["turn2"].num_cached_tokens == 24448
    assert result["turn2"].num_local_cached_tokens == 24448
    assert result["turn2"].num_external_cached_tokens == 0
    assert result["turn1"].num_cached_tokens == 0
    assert result["turn2"].arrival_step > result["turn1"].finish_step
    assert result.engine.key == "vllm==0.33.0"
    assert result.summary["cached_tokens"] == 24448
    with pytest.raises(KeyError, match="no request 'turn3' in this replay"):
        result["turn3"]


def test_fixture_in_a_users_test_file(tmp_path):
    (tmp_path / "test_mine.py").write_text(f'''
def test_turn2_hits(replayer_replay):
    result = replayer_replay({str(PAIR)!r})
    assert result["turn2"].num_cached_tokens == 24448

def test_turn2_would_need_a_whole_block_more(replayer_replay):
    assert replayer_replay({str(PAIR)!r})["turn2"].num_cached_tokens == 24576
''')
    proc = run_pytest("-q", "test_mine.py", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout
    assert "assert 24448 == 24576" in proc.stdout
