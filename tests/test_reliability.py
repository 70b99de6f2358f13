"""Issue 11: no hang, no exhausted memory, no traceback, no overwrite, on any input.

Each case feeds the input through the real command line (none of these import
vLLM) and checks the exit code, the one ``replayer: error:`` line naming the
file, and that nothing was written or lost. An input that could hang or exhaust
memory runs in a fresh interpreter, whose subprocess timeout is the hang
detector (every case ends in about a second); the plain refusals and outputs
run in this process (``cli_here``).
"""

from __future__ import annotations

import json
import os
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli_here
from helpers_traces import (SMALL_SCENARIO, assert_bad_input, cli, listing, make_trace_dir,
                            write_jsonl, write_text)

OK_REQ = "  - {id: a, prompt: {stream: s, len: 10}}\n"
HANG_TIMEOUT = 60
E30 = str(10**30)
BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def compile_fails(tmp_path, text: str | bytes, *needles: str) -> str:
    src = tmp_path / "bad.yaml"
    if isinstance(text, bytes):
        src.write_bytes(text)
    else:
        src.write_text(text)
    before = listing(tmp_path)
    line = assert_bad_input(cli("compile", src, "-o", tmp_path / "OUT", timeout=HANG_TIMEOUT),
                            "bad.yaml", *needles)
    assert listing(tmp_path) == before, "compile left files behind"
    return line


# --- item 6/7: hangs, memory, tracebacks in scenarios ---------------------------------

SCENARIO_CASES = {
    # An alias bomb: 1 KB that expands to 387 million strings.
    "alias_bomb_description": (BOMB + "description: *i\nrequests:\n" + OK_REQ, ["alias bomb"]),
    "alias_bomb_output_len": (
        BOMB + "requests:\n  - {id: a, prompt: {stream: s, len: 10}, output_len: *i}\n",
        ["alias bomb"]),
    "alias_bomb_after": (
        BOMB + "requests:\n" + OK_REQ + "  - {id: b, after: *i, prompt: {stream: s, len: 1}}\n",
        ["alias bomb"]),
    "recursive_alias": ("x: &x [*x]\nrequests:\n" + OK_REQ, ["an alias refers to itself at line 1"]),
    "huge_span": ("requests:\n  - {id: a, prompt: {stream: s, len: 300000000}}\n",
                  ["requests[0].prompt[0].len is 300000000, above the limit of 16777216"]),
    "span_1e12": ("requests:\n  - {id: a, prompt: {stream: s, len: 1000000000000}}\n",
                  ["above the limit of 16777216"]),
    "many_spans_add_up": (
        "requests:\n" + "".join(f"  - {{id: r{i}, prompt: {{stream: s, len: 16000000}}}}\n"
                                for i in range(3)),
        ["requests[2].prompt[0].len: the prompts add up to more than 33554432 tokens"]),
    "num_gpu_blocks_1e10": ("engine: {num_gpu_blocks: 10000000000}\nrequests:\n" + OK_REQ,
                            ["engine.num_gpu_blocks is 10000000000, above the limit of 4194304"]),
    "num_gpu_blocks_sized_past_the_limit": (
        "engine: {block_size: 1, kv_groups: [{kind: full_attention, block_size: 1}]}\n"
        "requests:\n  - {id: a, prompt: {stream: s, len: 2000000}}\n",
        ["engine.num_gpu_blocks omitted: sized for the longest request it would be 8000008, "
         "above the limit of 4194304"]),
    "int_1e30_block_size": (f"engine: {{block_size: {10**30}}}\nrequests:\n" + OK_REQ,
                            ["engine.block_size is " + E30 + ", above the limit"]),
    "int_1e30_start": (f"requests:\n  - {{id: a, prompt: {{stream: s, start: {10**30}, len: 3}}}}\n",
                       ["requests[0].prompt[0].start is " + E30]),
    "int_1e30_output_len": (f"requests:\n  - {{id: a, prompt: {{stream: s, len: 3}}, "
                            f"output_len: {10**30}}}\n", ["requests[0].output_len is " + E30 + ", above the limit of 16777216"]),
    "int_1e30_arrival_step": (f"requests:\n  - {{id: a, prompt: {{stream: s, len: 3}}, "
                              f"arrival_step: {10**30}}}\n",
                              ["requests[0].arrival_step is " + E30 + ", above the limit"]),
    "int_1e30_priority": (f"requests:\n  - {{id: a, prompt: {{stream: s, len: 3}}, "
                          f"priority: {10**30}}}\n", ["requests[0].priority must be an integer"]),
    "int_1e30_expect": ("requests:\n" + OK_REQ + f"expect:\n  a: {{num_cached_tokens: {10**30}}}\n",
                        ["expect.a.num_cached_tokens is " + E30]),
    "int_1e30_vocab": (f"engine: {{vocab_size: {10**30}}}\nrequests:\n" + OK_REQ,
                       ["engine.vocab_size is " + E30]),
    "int_1e30_group_block": (f"engine: {{kv_groups: [{{kind: full_attention, block_size: {10**30}}}]}}"
                             "\nrequests:\n" + OK_REQ, ["engine.kv_groups[0].block_size is"]),
    "int_5000_digits": ("requests:\n  - {id: a, prompt: {stream: s, len: " + "9" * 5000 + "}}\n",
                        ["invalid YAML value", "digits"]),
    "hash_seed_nul": ('engine: {hash_seed: "12\\0"}\nrequests:\n' + OK_REQ,
                      ["engine.hash_seed must be null, 'random' or an integer 0..4294967295"]),
    "hash_seed_1e30": (f"engine: {{hash_seed: {10**30}}}\nrequests:\n" + OK_REQ,
                       ["engine.hash_seed must be"]),
    "deep_nesting": ("requests: " + "[" * 100000 + "]" * 100000 + "\n",
                     ["nested deeper than 64 levels"]),
    "deep_mapping": ("description: " + "{a: " * 5000 + "1" + "}" * 5000 + "\nrequests:\n" + OK_REQ,
                     ["nested deeper than 64 levels"]),
    "duplicate_top_key": ("requests:\n" + OK_REQ + "requests:\n" + OK_REQ,
                          ["duplicate key 'requests' at line 3"]),
    "duplicate_engine_key": ("engine:\n  block_size: 16\n  block_size: 32\nrequests:\n" + OK_REQ,
                             ["duplicate key 'block_size' at line 3"]),
    "duplicate_request_key": ("requests:\n  - {id: a, prompt: {stream: s, len: 3}, id: b}\n",
                              ["duplicate key 'id' at line 2"]),
    "after_cycle": ("requests:\n  - {id: a, after: b, prompt: {stream: s, len: 3}}\n"
                    "  - {id: b, after: a, prompt: {stream: s, len: 3}}\n",
                    ["column 'after'", "'after' cycle: 'a' -> 'b' -> 'a'"]),
    "after_self": ("requests:\n" + OK_REQ + "  - {id: b, after: b, prompt: {stream: s, len: 3}}\n",
                   ["'after' cycle: 'b' -> 'b'"]),
    "prompt_over_max_model_len": (
        "engine: {max_model_len: 64}\nrequests:\n  - {id: a, prompt: {stream: s, len: 65}}\n",
        ["column 'num_prompt_tokens', row 0", "the prompt (length 65) is longer than the "
         "maximum model length of 64"]),
    "async_scheduling": ("engine: {async_scheduling: true}\nrequests:\n" + OK_REQ,
                         ["engine.async_scheduling: true is not replayed"]),
    "connector_flag_type": ("engine: {connector: mooncake_store, connector_config: "
                            "{load_async: 10}}\nrequests:\n" + OK_REQ,
                            ["engine.connector_config.load_async must be true or false"]),
}


@pytest.mark.parametrize("case", list(SCENARIO_CASES))
def test_scenario_bounds(tmp_path, case):
    text, needles = SCENARIO_CASES[case]
    compile_fails(tmp_path, text, *needles)


def test_huge_yaml_is_refused_without_reading_it(tmp_path):
    src = tmp_path / "bad.yaml"
    with src.open("wb") as fh:                 # 200 MB, sparse: costs no disk
        fh.truncate(200 << 20)
    assert_bad_input(cli("compile", src, "-o", tmp_path / "OUT", timeout=HANG_TIMEOUT),
                     "bad.yaml", "larger than 8 MiB")


# --- header.json, golden tables --------------------------------------------------------

def test_header_not_utf8(tmp_path):
    out = make_trace_dir(tmp_path)
    (out / "header.json").write_bytes(b'{"x": "\xff"}')
    assert_bad_input(cli_here("info", out), "header.json", "not UTF-8")


def test_header_nested_100000_deep(tmp_path):
    out = make_trace_dir(tmp_path)
    (out / "header.json").write_text("[" * 100000 + "]" * 100000)
    assert_bad_input(cli("info", out, timeout=HANG_TIMEOUT), "header.json",
                     "invalid JSON (nested too deeply)")


def test_header_block_tokens_1e12(tmp_path):
    out = make_trace_dir(tmp_path)
    header = json.loads((out / "header.json").read_text())
    header["prompt_blocks"] = {"block_tokens": 10**12}
    (out / "header.json").write_text(json.dumps(header))
    assert_bad_input(cli_here("info", out), "header.json",
                     "header.prompt_blocks.block_tokens is 1000000000000, above the limit")


def test_header_int_1e30(tmp_path):
    out = make_trace_dir(tmp_path)
    header = json.loads((out / "header.json").read_text())
    header["engine"]["max_num_seqs"] = 10**30
    (out / "header.json").write_text(json.dumps(header))
    assert_bad_input(cli_here("info", out), "header.json", "engine.max_num_seqs is " + E30)


def _golden(out, name: str, ids: list[str], engine: str) -> None:
    rows = [{"id": i, "num_prompt_tokens": 1, "num_cached_tokens": 0,
             "num_local_cached_tokens": 0, "num_external_cached_tokens": 0} for i in ids]
    from traces.model import schema
    table = pa.Table.from_pylist(rows, schema=schema.GOLDEN.arrow_schema())
    pq.write_table(table.replace_schema_metadata({"engine": engine}), out / "golden" / name)


def test_golden_with_duplicate_ids(tmp_path):
    out = make_trace_dir(tmp_path)
    _golden(out, "vllm-0.33.0.parquet", ["a", "b", "a"], "vllm==0.33.0")
    assert_bad_input(cli_here("info", out), "vllm-0.33.0.parquet", "column 'id', row 2",
                     "duplicate request id 'a'")


def test_golden_whose_metadata_names_another_engine(tmp_path):
    out = make_trace_dir(tmp_path)
    _golden(out, "vllm-0.33.0.parquet", ["a"], "vllm==0.29.0")
    assert_bad_input(cli_here("info", out), "vllm-0.33.0.parquet",
                     "its metadata names engine 'vllm==0.29.0'", "vllm-0.29.0.parquet")


# --- Mooncake JSONL --------------------------------------------------------------------

LINE = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}


@pytest.mark.parametrize("line, needles", [
    ({**LINE, "timestamp": 10**30}, ["column 'timestamp', row 0", E30]),
    ({**LINE, "input_length": 10**12}, ["column 'input_length'", "above the limit of 16777216"]),
    ('{"timestamp": ' + "[" * 100000 + "]" * 100000 + "}", ["row 0", "invalid JSON"]),
    ('{"timestamp": ' + "9" * 5000 + "}", ["row 0", "invalid JSON", "digits"]),
    ({**LINE, "hash_ids": list(range(40000))}, ["column 'hash_ids'", "too many block ids"]),
])
def test_mooncake_bounds(tmp_path, line, needles):
    src = write_jsonl(tmp_path / "m.jsonl", [line])
    before = listing(tmp_path)
    assert_bad_input(cli("import", "mooncake", src, "-o", tmp_path / "OUT",
                         timeout=HANG_TIMEOUT), "m.jsonl", *needles)
    assert listing(tmp_path) == before


def test_mooncake_from_dev_zero_stops_at_the_line_limit(tmp_path):
    proc = cli("import", "mooncake", "/dev/zero", "-o", tmp_path / "OUT", timeout=HANG_TIMEOUT)
    assert_bad_input(proc, "/dev/zero", "row 0", "line longer than 16 MiB")
    assert list(tmp_path.iterdir()) == []


# --- outputs: -o, --json, --store ------------------------------------------------------

def test_output_dot_is_refused(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    before = listing(tmp_path)
    assert_bad_input(cli_here("compile", src, "-o", ".", cwd=tmp_path),
                     "is the current directory")
    assert listing(tmp_path) == before


def test_output_under_a_file_is_refused(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    (tmp_path / "FILE").write_text("keep")
    assert_bad_input(cli_here("compile", src, "-o", tmp_path / "FILE" / "x"), "FILE/x",
                     "is a file, not a directory")
    assert (tmp_path / "FILE").read_text() == "keep"


def test_json_into_a_directory_is_refused_before_replaying(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    (tmp_path / "DIR").mkdir()
    proc = cli("run", src, "--json", tmp_path / "DIR", timeout=HANG_TIMEOUT)
    assert_bad_input(proc, "DIR", "is a directory; --json needs a file name")
    assert list((tmp_path / "DIR").iterdir()) == []


@pytest.mark.parametrize("value", ["1e999", "nan", "inf", "0"])
def test_store_capacity_not_finite(tmp_path, value):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    proc = cli("run", src, "--store-capacity", value, timeout=HANG_TIMEOUT)
    assert_bad_input(proc, f"--store-capacity {value!r}", "expected a size such as 64MB")


def test_store_on_a_trace_without_connector_is_refused(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    proc = cli("run", src, "--store", "mooncake://127.0.0.1:9", timeout=HANG_TIMEOUT)
    assert_bad_input(proc, "s.yaml", "--store mooncake://127.0.0.1:9 applies to a trace with "
                                     "engine.connector, and it has none")


# --- items 3 and 5: overwrite, --force, temporaries, umask -----------------------------

def _snapshot(folder):
    return {p: (folder / p).read_bytes() for p in sorted(listing(folder))
            if (folder / p).is_file()}


def test_compile_onto_an_existing_trace_needs_force(tmp_path):
    out = make_trace_dir(tmp_path, "OUT")          # SMALL_SCENARIO has goldens
    before = _snapshot(out)
    src = write_text(tmp_path / "s2.yaml", SMALL_SCENARIO.split("expect:")[0])
    assert_bad_input(cli_here("compile", src, "-o", out), "OUT",
                     "exists; pass --force to replace it")
    assert _snapshot(out) == before
    proc = cli_here("compile", src, "-o", out, "--force")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"replayer: note: replaced the existing trace {out} (--force), its goldens included: "
        "*.parquet"]
    assert not (out / "golden").exists()


def _recorded(out):
    header = json.loads((out / "header.json").read_text())
    header["source"] = {"kind": "recorded"}
    (out / "header.json").write_text(json.dumps(header))


@pytest.mark.parametrize("command", ["compile", "import", "anonymize"])
def test_force_never_replaces_a_recorded_trace(tmp_path, command):
    out = make_trace_dir(tmp_path, "OUT")
    _recorded(out)
    before = _snapshot(out)
    src = {"compile": lambda: write_text(tmp_path / "s.yaml", SMALL_SCENARIO),
           "import": lambda: write_jsonl(tmp_path / "m.jsonl", [LINE]),
           "anonymize": lambda: make_trace_dir(tmp_path, "OTHER")}[command]()
    args = ["import", "mooncake"] if command == "import" else [command]
    proc = cli_here(*args, src, "-o", out, "--force")
    assert_bad_input(proc, "OUT", "is a recorded trace; recorded observations are never replaced")
    assert _snapshot(out) == before


def test_anonymize_onto_its_input_is_refused(tmp_path):
    out = make_trace_dir(tmp_path, "T")
    before = _snapshot(out)
    assert_bad_input(cli_here("anonymize", out, "-o", out, "--force"), "T",
                     "is the input; write the output to another directory")
    assert _snapshot(out) == before


def test_import_onto_an_existing_trace_needs_force(tmp_path):
    out = make_trace_dir(tmp_path, "OUT")
    src = write_jsonl(tmp_path / "m.jsonl", [LINE])
    assert_bad_input(cli_here("import", "mooncake", src, "-o", out), "OUT", "pass --force")
    proc = cli_here("import", "mooncake", src, "-o", out, "--force")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "header.json").read_text())["source"]["kind"] == "imported"


def test_stale_temporaries_of_a_killed_import_are_cleaned_and_skipped(tmp_path):
    from replayer.cli.check import expand_targets as _expand_targets

    folder = tmp_path / "fixtures"
    make_trace_dir(folder, "conv")
    for stale in (".conv.tmp-999999999-0123abcd", ".conv.q8z_x1ab"):   # ours, and mkdtemp's
        make_trace_dir(folder, stale)
        (folder / f"{stale}.yaml").unlink()
    assert [p.name for p in _expand_targets([str(folder)])] == ["conv", "conv.yaml"]
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    proc = cli_here("compile", src, "-o", folder / "conv", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "removed " + str(folder / ".conv.tmp-999999999-0123abcd") in proc.stderr
    assert not (folder / ".conv.tmp-999999999-0123abcd").exists()


def test_outputs_get_the_users_umask(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    old = os.umask(0o022)
    try:
        assert cli_here("compile", src, "-o", tmp_path / "OUT").returncode == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "OUT").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "OUT" / "header.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "OUT" / "golden" / "*.parquet").stat().st_mode) == 0o644
    from traces.io.atomic import write_atomic

    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "out.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o640


# --- items 1 and 2: recorder write failures, recording into a used directory -----------

def _enospc(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "part.parquet")


def test_a_failed_flush_is_logged_at_once_and_fails_the_stop(tmp_path, monkeypatch, caplog):
    import time

    from traces.model import schema
    from traces.io import parts as w
    monkeypatch.setattr(w, "write_part", _enospc)
    pw = w.PartWriter(tmp_path / "rec", schema.STEPS, max_rows=1)
    pw.append({"step": 0, "id": "a", "num_scheduled_tokens": 5, "num_accepted_tokens": None})
    deadline = time.monotonic() + 30
    while not caplog.records and time.monotonic() < deadline:     # the log says it now
        time.sleep(0.01)
    assert "No space left on device" in caplog.text and "recording is incomplete" in caplog.text
    with pytest.raises(w.RecordingError, match="No space left on device"):
        pw.append({"step": 1, "id": "a", "num_scheduled_tokens": 1, "num_accepted_tokens": None})
    with pytest.raises(w.RecordingError, match="the recording is incomplete"):
        pw.close()


def test_every_table_gets_its_last_flush_when_one_fails(tmp_path, monkeypatch):
    from replayer.recorder.session import SchedulerSession
    from traces.io import parts as w
    real = w.write_part

    def fail_steps(folder, table, rank, seq):
        if folder.name == "steps":
            _enospc()
        return real(folder, table, rank, seq)

    monkeypatch.setattr(w, "write_part", fail_steps)
    s = SchedulerSession(str(tmp_path / "rec"))
    s.writers["steps"].append({"step": 0, "id": "a", "num_scheduled_tokens": 1,
                               "num_accepted_tokens": None})
    s.writers["events"].append({"after": None, "at_step": 0, "action": "abort", "target": "a"})
    with pytest.raises(w.RecordingError, match="steps table failed"):
        s.close()
    assert [p.name for p in (tmp_path / "rec" / "events").iterdir()] == [
        "part-r000-000000.parquet"]
    assert list((tmp_path / "rec" / "steps").iterdir()) == []      # no half part left


def test_recording_into_a_used_directory_is_refused(tmp_path):
    from replayer.recorder.session import SchedulerSession, StoreSession
    from traces.io.parts import RecordingError

    out = make_trace_dir(tmp_path, "old")
    before = _snapshot(out)
    with pytest.raises(RecordingError, match=r"is not empty \(holds events.parquet, golden, header.json, requests.parquet\); record each run into a new, empty directory"):
        SchedulerSession(str(out))
    with pytest.raises(RecordingError, match=r"already holds a recording \(header.json\)"):
        StoreSession(str(out), 0)
    assert _snapshot(out) == before
    (tmp_path / "new" / "store_ops").mkdir(parents=True)   # a worker rank started first: fine
    SchedulerSession(str(tmp_path / "new")).close()


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (root: a tmpfs mounted ro), else a directory we cannot write."""
    import subprocess

    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                       check=True)
        yield path
        subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)


def test_recording_into_a_read_only_directory_is_one_line(read_only_dir):
    from replayer.recorder.session import SchedulerSession
    from traces.io.parts import RecordingError

    with pytest.raises(RecordingError) as info:
        SchedulerSession(str(read_only_dir / "rec"))
    assert len(str(info.value).splitlines()) == 1
    assert "cannot record here (" in str(info.value) and str(read_only_dir) in str(info.value)
