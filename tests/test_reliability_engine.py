"""Issue 11 cases that start the installed vLLM: a full disk while recording,
vLLM's own config errors, ``--json -``.

A full disk is a 16 KiB tmpfs when the tests run as root (CI), else the part
writer fails as a full disk does (ENOSPC), injected in the same place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers_traces import REPO, SMALL_SCENARIO, assert_bad_input, cli, write_text

RAISE_ENOSPC = """
import errno, os
import traces.io.parts as w
def full(folder, *a):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
w.write_part = full
"""


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """(directory, env, preamble): a place whose writes fail with ENOSPC."""
    path = tmp_path / "full"
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(path)],
                       check=True)
        yield path, {"TMPDIR": str(path)}, ""
        subprocess.run(["umount", str(path)], check=True)
    else:
        exec(RAISE_ENOSPC, {})                       # this process: the library test
        import traces.io.parts as w
        monkeypatch.setattr(w, "write_part", w.write_part)
        yield path, {}, RAISE_ENOSPC


def test_disk_full_at_the_last_flush_fails_the_recording(tmp_path, full_disk):
    from replayer.check.recorded import record_replay
    from traces.scenarios.compile import compile_scenario
    from traces.io.parts import RecordingError

    where, _, _ = full_disk
    trace = compile_scenario(write_text(tmp_path / "s.yaml", SMALL_SCENARIO))
    with pytest.raises(RecordingError, match="No space left on device") as info:
        record_replay(trace, where / "rec")
    assert "the recording is incomplete" in str(info.value)
    assert not list((where / "rec").rglob("*.tmp")), "a half-written part was left"


def test_disk_full_through_the_cli_is_exit_2_and_one_line(tmp_path, full_disk):
    from replayer.check.recorded import record_replay
    from traces.scenarios.compile import compile_scenario

    _, env, preamble = full_disk
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    if preamble:                 # the fixture patched this process too: record without it
        import importlib

        import traces.io.parts as w
        importlib.reload(w)
    record_replay(compile_scenario(src), tmp_path / "rec")     # a whole recording
    script = preamble + ("import sys\nfrom replayer.cli.main import main\n"
                         f"sys.exit(main(['check', '--against', 'recorded', {str(tmp_path / 'rec')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})
    assert_bad_input(proc, "No space left on device", "the recording is incomplete")


@pytest.mark.parametrize("engine, needle", [
    ("{max_num_batched_tokens: 16, enable_chunked_prefill: false, max_model_len: 64}",
     "engine.max_num_batched_tokens: vLLM 0.33.0 cannot build this engine: "
     "max_num_batched_tokens (16) is smaller than max_model_len (64)"),
    ("{prefix_caching_hash_algo: md5}",
     "engine.prefix_caching_hash_algo: vLLM 0.33.0 cannot build this engine: Input should be "
     "'sha256', 'sha256_cbor', 'xxhash' or 'xxhash_cbor'"),
])
def test_vllm_config_errors_name_the_field_and_file(tmp_path, capsys, engine, needle):
    from replayer.cli.main import main

    src = write_text(tmp_path / "cfg.yaml", f"engine: {engine}\nrequests:\n"
                                            "  - {id: a, prompt: {stream: s, len: 10}}\n")
    assert main(["run", str(src), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"replayer: error: {src}: {needle}"), err
    assert "validation error for" not in err


def test_json_dash_makes_stdout_the_json_alone(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    proc = cli("run", src, "--json", "-", "--no-progress", timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)                      # nothing else on stdout
    assert [r["id"] for r in data["requests"]] == ["a", "b", "c"]
    assert proc.stderr.startswith("request  prompt"), proc.stderr


@pytest.mark.parametrize("target", [
    "fixtures/traces/live_eagle",                            # full attention + EAGLE draft layer
    "fixtures/scenarios/vllm51295_turn1_24577.yaml",         # full attention + Mamba, block 1536
    "fixtures/traces/live_qwen3_next",                       # three Mamba groups + full attention
    "fixtures/scenarios/sliding_window.yaml",
    "fixtures/scenarios/dcp_hybrid_eagle.yaml",
])
def test_the_smallest_pool_vllm_builds_is_its_own_and_its_refusal_is_said_whole(target):
    """``min_gpu_blocks`` (shrink's floor for num_gpu_blocks) is exactly vLLM's: the
    engine builds with that many blocks and vLLM refuses one fewer. The floor
    shrink used (one max_model_len request in a full-attention block) was below it
    (128 for live_eagle, where vLLM needs 129), and vLLM's refusal was cut at 300
    characters, mid-sentence."""
    from dataclasses import replace

    from replayer.replay.engines import EngineError
    from replayer.replay.execution.in_process import engine_here
    from traces import load_target

    trace = load_target(REPO / target)

    def sized(blocks: int):
        return replace(trace, header={**trace.header,
                                      "engine": trace.engine.with_settings(num_gpu_blocks=blocks)})

    with engine_here(trace) as adapter:
        floor = adapter.min_gpu_blocks()
    assert floor is not None and floor > 1
    with engine_here(sized(floor)) as adapter:
        assert adapter.min_gpu_blocks() == floor
    with pytest.raises(EngineError) as refused:
        with engine_here(sized(floor - 1)):
            pass
    said = str(refused.value)
    assert said.startswith("vLLM 0.33.0 cannot build this engine: To serve at least one "
                           "request with the model's max seq len"), said
    assert said.endswith(" for more details."), said                   # whole, not cut
