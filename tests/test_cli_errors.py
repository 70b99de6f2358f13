"""Every bad input: exit 2, one ``replayer: error:`` line naming file and fault, no output.

Each case runs the real command line in this process (``cli_here``): none gets as
far as a replay. Trace-reading errors go through ``info`` and ``compile`` (neither
imports vLLM); one case goes through ``run`` to show it reports them the same way,
before any engine runs.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli_here
from helpers_traces import (SMALL_SCENARIO, assert_bad_input, listing, make_trace_dir,
                            replace_column, rewrite_requests, write_jsonl, write_text)

OK_REQ = "  - {id: a, prompt: {stream: s, len: 10}}\n"


def compile_fails(tmp_path, text: str | bytes, *needles: str, name: str = "bad.yaml") -> str:
    """``compile`` a bad scenario: error names the file; no OUT, nothing beside it."""
    src = tmp_path / name
    if isinstance(text, bytes):
        src.write_bytes(text)
    else:
        write_text(src, text)
    before = listing(tmp_path)
    proc = cli_here("compile", src, "-o", tmp_path / "OUT")
    line = assert_bad_input(proc, name, *needles)
    assert not (tmp_path / "OUT").exists()
    assert listing(tmp_path) == before, "compile left files behind"
    return line


# --- scenarios -------------------------------------------------------------------------

SCENARIO_CASES = {
    "unknown_top_level_key": (
        "requests:\n" + OK_REQ + "expectations: {}\n",
        ["unknown key 'expectations' in the scenario"]),
    "unknown_request_key": (
        "requests:\n" + OK_REQ + "  - {id: b, promt: {stream: s, len: 10}}\n",
        ["unknown key 'promt' in requests[1]"]),
    "unknown_span_key": (
        "requests:\n  - {id: a, prompt: {stream: s, length: 10}}\n",
        ["unknown key 'length' in requests[0].prompt[0]"]),
    "unknown_engine_key": (
        "engine: {block_size: 16, blok_size: 32}\nrequests:\n" + OK_REQ,
        ["unknown engine key 'blok_size'"]),
    "engine_wrong_type": (
        "engine: {block_size: '16'}\nrequests:\n" + OK_REQ,
        ["engine.block_size has the wrong type str"]),
    "bad_group_kind": (
        "engine:\n  kv_groups: [{kind: full_attention}, {kind: linear}]\nrequests:\n" + OK_REQ,
        ["engine.kv_groups[1].kind 'linear'", "full_attention"]),
    "unknown_group_key": (
        "engine:\n  kv_groups: [{kind: full_attention, window: 4}]\nrequests:\n" + OK_REQ,
        ["unknown key 'window' in engine.kv_groups[0]"]),
    "invalid_yaml": (
        "requests:\n  - {id: a, prompt: {stream: s, len: 10}\n",
        ["invalid YAML at line 3"]),
    "invalid_yaml_tab": (
        "requests:\n\t- {id: a}\n",
        ["invalid YAML at line 2"]),
    "not_a_mapping": (
        "- just\n- a list\n",
        ["a scenario must be a YAML mapping"]),
    "after_unknown_id": (
        "requests:\n" + OK_REQ + "  - {id: b, after: nope, prompt: {stream: s, len: 10}}\n",
        ["column 'after', row 1", "request arrives after unknown id 'nope'"]),
    "after_and_arrival_step": (
        "requests:\n" + OK_REQ
        + "  - {id: b, after: a, arrival_step: 3, prompt: {stream: s, len: 10}}\n",
        ["requests[1]: give either after or arrival_step"]),
    "expect_unknown_request": (
        "requests:\n" + OK_REQ + "expect:\n  zz: {num_cached_tokens: 0}\n",
        ["expect names unknown request 'zz'"]),
    "expect_unknown_field": (
        "requests:\n" + OK_REQ + "expect:\n  a: {cached: 0}\n",
        ["unknown key 'cached' in expect.a"]),
    "duplicate_id": (
        "requests:\n" + OK_REQ + "  - {id: b, prompt: {stream: s, len: 3}}\n" + OK_REQ,
        ["column 'id', row 2", "duplicate request id 'a'"]),
    "negative_output_len": (
        "requests:\n  - {id: a, prompt: {stream: s, len: 10}, output_len: 0}\n",
        ["requests[0].output_len must be an integer >= 1, got 0"]),
    "event_unknown_action": (
        "requests:\n" + OK_REQ + "events:\n  - {after: a, action: flush}\n",
        ["events[0].action must be one of", "got 'flush'"]),
    "no_requests": (
        "engine: {block_size: 16}\n",
        ["requests must be a non-empty list"]),
    "unknown_scheduling_policy": (
        "engine: {scheduling_policy: lifo}\nrequests:\n" + OK_REQ,
        ["engine.scheduling_policy 'lifo': expected one of fcfs, priority"]),
    "priority_not_an_integer": (
        "requests:\n  - {id: a, prompt: {stream: s, len: 10}, priority: high}\n",
        ["requests[0].priority must be an integer"]),
}


@pytest.mark.parametrize("case", list(SCENARIO_CASES))
def test_scenario_errors_through_compile(tmp_path, case):
    text, needles = SCENARIO_CASES[case]
    line = compile_fails(tmp_path, text, *needles)
    # the scenario file itself is named, not a table file that does not exist
    assert ".parquet" not in line


def test_scenario_not_utf8(tmp_path):
    compile_fails(tmp_path, b"requests:\n  - {id: \xff}\n", "not UTF-8 text")


def test_scenario_control_character(tmp_path):
    compile_fails(tmp_path, 'description: "\x07"\nrequests:\n' + OK_REQ, "invalid YAML",
                  "unacceptable character")


def test_scenario_missing_file(tmp_path):
    proc = cli_here("compile", tmp_path / "nope.yaml", "-o", tmp_path / "OUT")
    assert_bad_input(proc, "nope.yaml", "no such file")
    assert list(tmp_path.iterdir()) == []


def test_scenario_is_a_directory(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    proc = cli_here("compile", tmp_path / "dir.yaml", "-o", tmp_path / "OUT")
    assert_bad_input(proc, "dir.yaml", "cannot read")
    assert not (tmp_path / "OUT").exists()


def test_scenario_error_through_info(tmp_path):
    src = write_text(tmp_path / "s.yaml", "requests:\n" + OK_REQ + "extra: 1\n")
    assert_bad_input(cli_here("info", src), "s.yaml", "unknown key 'extra' in the scenario")


def test_compile_onto_a_file_refuses(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    target = tmp_path / "OUT"
    target.write_text("keep me")
    before = listing(tmp_path)
    assert_bad_input(cli_here("compile", src, "-o", target), "OUT", "not a trace directory")
    assert target.read_text() == "keep me"
    assert listing(tmp_path) == before


def test_compile_onto_a_foreign_directory_refuses(tmp_path):
    src = write_text(tmp_path / "s.yaml", SMALL_SCENARIO)
    (tmp_path / "OUT").mkdir()
    (tmp_path / "OUT" / "notes.txt").write_text("keep me")
    before = listing(tmp_path)
    assert_bad_input(cli_here("compile", src, "-o", tmp_path / "OUT"), "OUT",
                     "not a trace directory")
    assert listing(tmp_path) == before


def test_failed_compile_keeps_the_previous_trace(tmp_path):
    out = make_trace_dir(tmp_path, "OUT")
    before = {p: (out / p).read_bytes() for p in listing(out) if (out / p).is_file()}
    bad = write_text(tmp_path / "bad.yaml", "requests:\n" + OK_REQ + "bogus: 1\n")
    assert_bad_input(cli_here("compile", bad, "-o", out, "--force"), "bad.yaml",
                     "unknown key 'bogus'")
    assert {p: (out / p).read_bytes() for p in listing(out) if (out / p).is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT", "OUT.yaml", "bad.yaml"]


# --- trace directories -----------------------------------------------------------------

def _int32(table: pa.Table, name: str) -> pa.Table:
    return replace_column(table, name, table[name].cast(pa.int32()).combine_chunks())


def _tokens_row(row: int, value: int):
    def change(table: pa.Table) -> pa.Table:
        lists = table["prompt_tokens"].to_pylist()
        lists[row][3] = value
        return replace_column(table, "prompt_tokens", pa.array(lists, pa.list_(pa.int32())))
    return change


def _ids(ids):
    return lambda t: replace_column(t, "id", pa.array(ids, pa.string()))


TRACE_CASES = {
    "missing_column": (
        lambda t: t.drop_columns(["output_len"]),
        ["requests.parquet", "column 'output_len'", "missing column"]),
    "wrong_column_type": (
        lambda t: _int32(t, "output_len"),
        ["requests.parquet", "column 'output_len'", "wrong type int32, expected int64"]),
    "unknown_column": (
        lambda t: t.append_column("colour", pa.array(["r", "g", "b"])),
        ["requests.parquet", "column 'colour'", "unknown column"]),
    "null_in_required_column": (
        lambda t: replace_column(t, "num_prompt_tokens", pa.array([47, None, 33], pa.int64())),
        ["requests.parquet", "column 'num_prompt_tokens', row 1", "null value"]),
    "token_out_of_vocabulary": (
        _tokens_row(2, 32000),
        ["requests.parquet", "column 'prompt_tokens', row 2",
         "token id 32000 out of vocabulary [0, 32000)"]),
    "negative_token": (
        _tokens_row(1, -5),
        ["requests.parquet", "column 'prompt_tokens', row 1", "token id -5 out of vocabulary"]),
    "duplicate_request_id": (
        _ids(["a", "b", "a"]),
        ["requests.parquet", "column 'id', row 2", "duplicate request id 'a'"]),
    "tokens_length_differs": (
        lambda t: replace_column(t, "num_prompt_tokens", pa.array([47, 50, 33], pa.int64())),
        ["requests.parquet", "column 'prompt_tokens', row 1",
         "list length differs from num_prompt_tokens"]),
    "after_unknown_id": (
        lambda t: replace_column(t, "after", pa.array([None, "zz", None], pa.string())),
        ["requests.parquet", "column 'after', row 1", "unknown id 'zz'"]),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_bad_requests_table_through_info(tmp_path, case):
    change, needles = TRACE_CASES[case]
    trace = make_trace_dir(tmp_path)
    rewrite_requests(trace, change)
    assert_bad_input(cli_here("info", trace), str(trace), *needles)


def test_missing_requests_table(tmp_path):
    trace = make_trace_dir(tmp_path)
    (trace / "requests.parquet").unlink()
    assert_bad_input(cli_here("info", trace), str(trace / "requests.parquet"), "missing")


def test_unreadable_parquet(tmp_path):
    trace = make_trace_dir(tmp_path)
    (trace / "requests.parquet").write_bytes(b"not parquet at all")
    assert_bad_input(cli_here("info", trace), "requests.parquet", "not a readable Parquet file")


def test_unknown_schema_version(tmp_path):
    trace = make_trace_dir(tmp_path)
    header = json.loads((trace / "header.json").read_text())
    header["schema_version"] = 99
    (trace / "header.json").write_text(json.dumps(header))
    assert_bad_input(cli_here("info", trace), str(trace / "header.json"),
                     "unknown schema version 99")


def test_header_invalid_json(tmp_path):
    trace = make_trace_dir(tmp_path)
    (trace / "header.json").write_text('{"schema_version": 1,')
    assert_bad_input(cli_here("info", trace), "header.json", "invalid JSON")


def test_header_unknown_engine_key(tmp_path):
    trace = make_trace_dir(tmp_path)
    header = json.loads((trace / "header.json").read_text())
    header["engine"]["gpu_blocks"] = 10
    (trace / "header.json").write_text(json.dumps(header))
    assert_bad_input(cli_here("info", trace), "header.json", "unknown engine key 'gpu_blocks'")


def test_not_a_trace_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_bad_input(cli_here("info", tmp_path / "empty"), "empty", "not a trace directory")


def test_missing_trace_directory(tmp_path):
    assert_bad_input(cli_here("info", tmp_path / "gone"), "gone", "no such file or directory")


def test_golden_for_unknown_request(tmp_path):
    trace = make_trace_dir(tmp_path)
    golden = next((trace / "golden").glob("*.parquet"))
    table = pq.read_table(golden)
    table = replace_column(table, "id", pa.array(["b", "ghost"], pa.string()))
    pq.write_table(table, golden)
    assert_bad_input(cli_here("info", trace), "golden", "column 'id', row 1",
                     "golden for unknown request 'ghost'")


def test_run_reports_a_bad_trace_the_same_way(tmp_path):
    trace = make_trace_dir(tmp_path)
    rewrite_requests(trace, _tokens_row(2, 40000))
    info_line = assert_bad_input(cli_here("info", trace))
    run_line = assert_bad_input(cli_here("run", trace, "--no-progress"), str(trace),
                                "column 'prompt_tokens', row 2", "token id 40000")
    assert run_line == info_line


# --- Mooncake import -------------------------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def import_fails(tmp_path, lines, *needles: str, extra: tuple[str, ...] = ()) -> str:
    src = write_jsonl(tmp_path / "m.jsonl", lines)
    before = listing(tmp_path)
    proc = cli_here("import", "mooncake", src, "-o", tmp_path / "OUT", *extra)
    line = assert_bad_input(proc, "m.jsonl", *needles)
    assert not (tmp_path / "OUT").exists()
    assert listing(tmp_path) == before, "import left files behind"
    return line


MOONCAKE_CASES = {
    "invalid_json": (
        [GOOD, GOOD, '{"timestamp": 5, "input_length": 10,'],
        ["row 2", "invalid JSON"]),
    "not_an_object": ([GOOD, "[1, 2, 3]"], ["row 1", "a line must be a JSON object"]),
    "missing_field": (
        [GOOD, {"timestamp": 1, "input_length": 10, "output_length": 1}],
        ["column 'hash_ids', row 1", "missing field"]),
    "missing_timestamp": (
        [{"input_length": 10, "output_length": 1, "hash_ids": [1]}],
        ["column 'timestamp', row 0", "missing field"]),
    "hash_ids_too_short": (
        [GOOD, GOOD, {"timestamp": 3, "input_length": 1100, "output_length": 1,
                      "hash_ids": [1, 2]}],
        ["column 'hash_ids', row 2", "2 blocks of 512 tokens cannot hold input_length 1100"]),
    "hash_id_not_int": (
        [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}],
        ["column 'hash_ids', row 0"]),
    "hash_id_too_large": (
        [GOOD, {"timestamp": 0, "input_length": 10, "output_length": 1,
                "hash_ids": [2 ** 64]}],
        ["column 'hash_ids', row 1", "64-bit"]),
    "negative_length": (
        [{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": [1]}],
        ["column 'input_length', row 0", "non-negative integer"]),
    "float_timestamp": (
        [{"timestamp": 1.5, "input_length": 3, "output_length": 1, "hash_ids": [1]}],
        ["column 'timestamp', row 0", "non-negative integer, got 1.5"]),
    "timestamps_backwards": (
        [{**GOOD, "timestamp": 100}, {**GOOD, "timestamp": 99}],
        ["column 'timestamp', row 1", "must not go backwards"]),
    "empty_line": ([GOOD, ""], ["row 1", "empty line"]),
    "no_requests": ([], ["no requests"]),
}


@pytest.mark.parametrize("case", list(MOONCAKE_CASES))
def test_mooncake_errors(tmp_path, case):
    lines, needles = MOONCAKE_CASES[case]
    import_fails(tmp_path, lines, *needles)


def test_mooncake_not_utf8(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    proc = cli_here("import", "mooncake", src, "-o", tmp_path / "OUT")
    assert_bad_input(proc, "m.jsonl", "row 1", "not UTF-8 text")
    assert not (tmp_path / "OUT").exists()


def test_mooncake_missing_file(tmp_path):
    proc = cli_here("import", "mooncake", tmp_path / "none.jsonl", "-o", tmp_path / "OUT")
    assert_bad_input(proc, "none.jsonl", "cannot read")
    assert list(tmp_path.iterdir()) == []


def test_mooncake_error_keeps_the_previous_trace(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    assert cli_here("import", "mooncake", good, "-o", tmp_path / "OUT").returncode == 0
    header = (tmp_path / "OUT" / "header.json").read_text()
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "{"])
    assert_bad_input(cli_here("import", "mooncake", bad, "-o", tmp_path / "OUT", "--force"),
                     "bad.jsonl", "row 1")
    assert (tmp_path / "OUT" / "header.json").read_text() == header
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT", "bad.jsonl", "good.jsonl"]


ENGINE_FILE_CASES = {
    "unknown_top_level_key": ("engine: {block_size: 16}\nmodel: llama\n",
                              ["unknown key 'model'", "only 'engine:'"]),
    "unknown_engine_key": ("engine: {block_size: 16, num_blocks: 9}\n",
                           ["unknown engine key 'num_blocks'"]),
    "no_engine_block": ("{}\n", ["no 'engine:' block"]),
    "bad_group_kind": ("engine:\n  kv_groups: [{kind: linear}]\n",
                       ["kv_groups[0].kind 'linear'"]),
}


@pytest.mark.parametrize("case", list(ENGINE_FILE_CASES))
def test_import_engine_file_errors(tmp_path, case):
    text, needles = ENGINE_FILE_CASES[case]
    write_text(tmp_path / "eng.yaml", text)
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD])
    before = listing(tmp_path)
    proc = cli_here("import", "mooncake", src, "-o", tmp_path / "OUT", "--engine",
               tmp_path / "eng.yaml")
    assert_bad_input(proc, "eng.yaml", *needles)
    assert listing(tmp_path) == before


def test_import_engine_file_missing(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD])
    proc = cli_here("import", "mooncake", src, "-o", tmp_path / "OUT", "--engine",
               tmp_path / "none.yaml")
    assert_bad_input(proc, "none.yaml", "no such file")
    assert not (tmp_path / "OUT").exists()


@pytest.mark.parametrize("flag, value, needle", [("--limit", "0", "--limit must be at least 1"),
                                                 ("--step-ms", "0", "--step-ms must be at least 1")])
def test_import_bad_option(tmp_path, flag, value, needle):
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD])
    proc = cli_here("import", "mooncake", src, "-o", tmp_path / "OUT", flag, value)
    assert_bad_input(proc, needle)
    assert not (tmp_path / "OUT").exists()
