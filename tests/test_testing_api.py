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


def docs_example() -> str:
    """The python block of docs/pytest.md, as a user copies it."""
    text = (REPO / "docs" / "pytest.md").read_text()
    blocks = text.split("```python\n")[1:]
    assert len(blocks) == 1, "docs/pytest.md: one python example expected"
    return blocks[0].split("```")[0]


def test_fixture_in_a_users_test_file(tmp_path):
    """Two tests of a user's own, and docs/pytest.md's example as written (its
    scenario path relative to where pytest runs, as in a clone)."""
    copied = tmp_path / PAIR.relative_to(REPO)
    copied.parent.mkdir(parents=True)
    copied.write_bytes(PAIR.read_bytes())
    (tmp_path / "test_mine.py").write_text(f'''
def test_turn2_hits(replayer_replay):
    result = replayer_replay({str(PAIR)!r})
    assert result["turn2"].num_cached_tokens == 24448

def test_turn2_would_need_a_whole_block_more(replayer_replay):
    assert replayer_replay({str(PAIR)!r})["turn2"].num_cached_tokens == 24576
''' + "\n" + docs_example())
    proc = run_pytest("-q", "test_mine.py", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 2 passed" in proc.stdout
    assert "assert 24448 == 24576" in proc.stdout


def test_the_pytest_page_says_how_pytest_is_installed():
    """make demo installs the [replay] extra only: the page names the extra that
    brings pytest, and that extra has it."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("pytest>") for d in extras["test"])
    assert any(d.startswith("pytest-xdist") for d in extras["test"])
    assert ".venv/bin/pip install -e '.[replay,test]'" in (REPO / "docs" / "pytest.md").read_text()
