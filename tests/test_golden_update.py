"""``--update-golden`` rewrites goldens whole, readable, in place (no vLLM: fake replays).

The update path is the replayer's own (:mod:`replayer.check.goldens`); only the
replay is a stand-in, a :class:`ReplayResult` built here, so each YAML case
runs in milliseconds.
"""

from __future__ import annotations

import os
import re
import stat
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from replayer.check import goldens as golden_check
from replayer.replay.engines.base import EngineInfo
from replayer.replay.loop import ReplayResult
from traces import TraceError, load_target
from traces.model.outcome import RequestOutcome
from traces.trace import write_trace

ENGINE = "engine: {block_size: 16}\n"
STORE_ENGINE = "engine: {block_size: 16, connector: mooncake_store}\n"


def fake_result(trace, cached=7, store_rows=None) -> ReplayResult:
    """What a replay of ``trace`` might report: ``cached`` tokens for every request."""
    reqs = [RequestOutcome(id=rid, arrival_step=i, num_prompt_tokens=20, num_cached_tokens=cached,
                           num_local_cached_tokens=cached, num_external_cached_tokens=0)
            for i, rid in enumerate(trace.requests["id"].to_pylist())]
    store = None
    if store_rows is not None:
        store = {"backend": "memory", "rows": store_rows, "lookups": [
            {"request": reqs[0].id, "num_tokens": 20, "hit_length": 16, "step": 0}]}
    return ReplayResult(engine=EngineInfo("0.33.0"), requests=reqs, steps=3, store=store)


def put(request: str, boundary: int | None) -> dict:
    return {"op": "put", "result": 0, "request": request, "group": 0, "boundary": boundary,
            "key": f"k{boundary}"}


def scenario(tmp_path: Path, text: str, name: str = "s.yaml", engine: str = ENGINE) -> Path:
    path = tmp_path / name
    path.write_text(engine + textwrap.dedent(text))
    return path


def update(path: Path, **kwargs) -> list[str]:
    trace = load_target(path)
    return golden_check.update(path, trace, fake_result(trace, **kwargs))


def test_ids_that_yaml_reads_as_other_types_are_quoted(tmp_path):
    path = scenario(tmp_path, """\
        requests:
          - {id: "yes", prompt: {stream: s, len: 20}}
          - {id: "null", prompt: {stream: s, len: 20}}
          - {id: "0x10", prompt: {stream: s, len: 20}}
          - {id: "#c", prompt: {stream: s, len: 20}}
          - {id: "on", prompt: {stream: s, len: 20}}
        """)
    update(path, cached=16)
    text = path.read_text()
    for rid in ("yes", "null", "0x10", "#c", "on"):
        assert f'"{rid}": {{num_cached_tokens: 16}}' in text
    goldens = load_target(path).goldens
    assert goldens == {"*": {rid: {"num_cached_tokens": 16}
                             for rid in ("yes", "null", "0x10", "#c", "on")}}


def test_comments_and_everything_outside_the_goldens_stay_byte_for_byte(tmp_path):
    head = textwrap.dedent("""\
        # the requests
        requests:
          - id: a                # first
            prompt: [{stream: s, len: 20}]
          - {id: b, after: a, prompt: [{stream: s, len: 20}]}
        """)
    path = scenario(tmp_path, head + textwrap.dedent("""\
        expect:                  # reviewed by hand
          # a is the cold start
          a: {num_cached_tokens: 0}   # always a miss
          b: {num_cached_tokens: 16}
        description: kept after the block
        """))
    update(path, cached=5)
    text = path.read_text()
    assert text.startswith(ENGINE + head)
    assert "expect:                  # reviewed by hand\n" in text
    assert "  # a is the cold start\n  a: {num_cached_tokens: 5}   # always a miss\n" in text
    assert "  b: {num_cached_tokens: 5}\n" in text
    assert text.endswith("description: kept after the block\n")


def test_a_flow_mapping_continued_at_column_0_stays_valid(tmp_path):
    path = scenario(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}}
          - {id: b, prompt: {stream: s, len: 20}}
        expect: {a: {num_cached_tokens: 1},
        b: {num_cached_tokens: 2}}
        """)
    update(path, cached=3)
    assert load_target(path).goldens == {"*": {"a": {"num_cached_tokens": 3},
                                               "b": {"num_cached_tokens": 3}}}


def test_keyed_goldens_gain_the_engine_beside_the_others(tmp_path):
    path = scenario(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}}
        expect:
          "vllm==0.29.0":   # production
            a: {num_cached_tokens: 0}
        """)
    lines = update(path, cached=9)
    assert "goldens for vllm==0.33.0 rewritten" in lines[0]
    assert load_target(path).goldens == {"vllm==0.29.0": {"a": {"num_cached_tokens": 0}},
                                         "vllm==0.33.0": {"a": {"num_cached_tokens": 9}}}
    assert '"vllm==0.29.0":   # production\n' in path.read_text()


def test_an_update_keeps_the_entry_another_engine_wrote_while_it_replayed(tmp_path):
    """Two --update-golden runs on other engines of one scenario: the second read
    the file before the first wrote, and must not erase the first's entry."""
    path = scenario(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}}
        expect:
          "vllm==0.29.0": {a: {num_cached_tokens: 0}}
        """)
    stale = load_target(path)  # read before the other engine's update below
    other = fake_result(stale, cached=5)
    other.engine = EngineInfo("0.31.0")
    golden_check.update(path, load_target(path), other)
    golden_check.update(path, stale, fake_result(stale, cached=9))
    assert set(load_target(path).goldens) == {"vllm==0.29.0", "vllm==0.31.0", "vllm==0.33.0"}


def test_file_mode_is_kept_and_a_new_file_follows_the_umask(tmp_path):
    path = scenario(tmp_path, "requests: [{id: a, prompt: {stream: s, len: 20}}]\n")
    path.chmod(0o644)
    update(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o640)
    update(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_symlinked_scenario_stays_a_link_and_its_target_is_rewritten(tmp_path):
    target = scenario(tmp_path, "requests: [{id: a, prompt: {stream: s, len: 20}}]\n",
                      name="real.yaml")
    link = tmp_path / "link.yaml"
    link.symlink_to(target.name)
    update(link, cached=4)
    assert link.is_symlink() and os.readlink(link) == "real.yaml"
    assert load_target(target).goldens == {"*": {"a": {"num_cached_tokens": 4}}}


STORE_SCENARIO = """\
    requests:
      - {id: a, prompt: {stream: s, len: 20}}
    expect:
      a: {num_cached_tokens: 0}
    expect_store:
      puts:
        a: {0: [16]}   # the first block
      lookups: {a: 0}
    """


def test_request_and_store_goldens_are_written_together(tmp_path):
    path = scenario(tmp_path, STORE_SCENARIO, engine=STORE_ENGINE)
    lines = update(path, cached=16, store_rows=[put("a", 16), put("a", 32)])
    assert lines[1] == f"UPDATED {path}: store goldens rewritten in {path} (expect_store:)"
    trace = load_target(path)
    assert trace.goldens == {"*": {"a": {"num_cached_tokens": 16}}}
    assert trace.store_goldens == {"*": {"puts": {"a": {0: [16, 32]}}, "lookups": {"a": 16}}}
    assert re.search(r"\n    a: \{0: \[16, 32\]\} +# the first block\n", path.read_text())


def test_a_store_golden_that_would_not_read_back_writes_neither_block(tmp_path):
    path = scenario(tmp_path, STORE_SCENARIO, engine=STORE_ENGINE)
    before = path.read_bytes()
    with pytest.raises(TraceError, match="would not read back") as err:
        update(path, cached=16, store_rows=[put("a", None)])     # a key of unknown boundary
    assert str(path) in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]     # no temporary left


def test_duplicate_keys_in_the_goldens_are_refused_before_writing(tmp_path):
    path = scenario(tmp_path, """\
        requests:
          - {id: a, prompt: {stream: s, len: 20}}
        expect:
          a: {num_cached_tokens: 0}
          a: {num_cached_tokens: 1}
        """)
    before = path.read_bytes()
    # Refused as soon as the scenario loads (a repeated key is never silently dropped).
    with pytest.raises(TraceError, match="duplicate key 'a' at line 6"):
        update(path)
    assert path.read_bytes() == before


def test_trace_directory_gets_both_golden_tables(tmp_path):
    src = scenario(tmp_path, STORE_SCENARIO, engine=STORE_ENGINE)
    out = write_trace(load_target(src), tmp_path / "trace")
    trace = load_target(out)
    golden_check.update(out, trace, fake_result(trace, cached=16, store_rows=[put("a", 16)]))
    assert pq.read_table(out / "golden" / "vllm-0.33.0.parquet").to_pylist() == [
        {"id": "a", "num_prompt_tokens": 20, "num_cached_tokens": 16,
         "num_local_cached_tokens": 16, "num_external_cached_tokens": 0}]
    again = load_target(out)
    assert again.store_goldens["vllm==0.33.0"] == {"puts": {"a": {0: [16]}}, "lookups": {"a": 16}}


@contextmanager
def fake_engine_runner(result_for):
    yield lambda trace, progress=None, store=None: result_for(trace)


def test_cli_update_error_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    from replayer.cli import main as cli
    from replayer.replay.execution import clients as runner

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_LOGGING_LEVEL", "TORCH_LOGS",
                 "GLOG_minloglevel", "MC_LOG_LEVEL", "MC_YLT_LOG_LEVEL"):
        monkeypatch.setenv(name, os.environ.get(name, "0"))     # restored after the test
    monkeypatch.setattr(runner, "engine_runner", lambda spec, **kw: fake_engine_runner(
        lambda trace: fake_result(trace, store_rows=[put("a", None)])))
    path = scenario(tmp_path, STORE_SCENARIO, engine=STORE_ENGINE)
    before = path.read_bytes()
    assert cli.main(["check", "--update-golden", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"replayer: error: {path}: ")
    assert path.read_bytes() == before
