"""Property-based input fuzzing (Hypothesis): whatever a file holds, the loaders
end in a trace or one TraceError, never another exception, a hang or a
memory blow-up; the command line exits 0, 1 or 2 with no traceback.

The loaders (scenario YAML, trace directories, Mooncake JSONL) run in this
process, so hundreds of examples cost seconds; a smaller sample goes through
``python -m replayer`` under a memory limit. ``make test`` runs the ``ci``
profile: a fixed seed (derandomize) and a bounded example count. For a long
local run: ``HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from helpers_traces import REPO, SMALL_SCENARIO, make_trace_dir

from traces import TraceError
from traces.importers.mooncake import import_mooncake
from traces.scenarios.compile import compile_scenario
from traces.trace import read_trace, write_trace

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

settings.register_profile("ci", max_examples=120, derandomize=True, deadline=None,
                          database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("long", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
CLI_EXAMPLES = 6 if PROFILE == "ci" else 150
EXAMPLE_SECONDS = 20            # a hang detector (shared, loaded CI machines), not a target
CLI_MEMORY_BYTES = 6 << 30      # address space of one command: no input may need more

EXTREME = [0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**12,
           10**30, -10**30, 16_777_217, 300_000_000]
ints = st.one_of(st.integers(-5, 5000), st.sampled_from(EXTREME))
texts = st.text(max_size=12)                 # any code point: NUL, controls, emoji
scalars = st.one_of(st.none(), st.booleans(), ints, texts,
                    st.floats(allow_nan=True, allow_infinity=True))
anything = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.one_of(texts, ints), kids, max_size=4)),
    max_leaves=16)
keys = st.one_of(st.sampled_from(["a", "b", "c", "yes", "null", "0x10"]), ints, texts)
ids = st.one_of(keys, anything)


def sometimes(strategy):
    """Mostly the plausible shape, now and then anything at all."""
    return st.one_of(strategy, strategy, strategy, strategy, strategy, anything)


small = st.integers(1, 600)
bools = st.booleans()
span = st.fixed_dictionaries(
    {"stream": sometimes(st.sampled_from(["s", "doc", "q"])), "len": sometimes(small)},
    optional={"start": sometimes(st.one_of(small, ints))})
request = st.fixed_dictionaries(
    {"id": sometimes(keys), "prompt": sometimes(st.one_of(span, st.lists(span, max_size=3)))},
    optional={"output_len": sometimes(small), "after": sometimes(keys),
              "arrival_step": sometimes(st.integers(0, 20)), "cache_salt": sometimes(texts),
              "priority": sometimes(st.integers(-3, 3))})
group = st.fixed_dictionaries(
    {"kind": sometimes(st.sampled_from(["full_attention", "mamba", "sliding_window", "mla"]))},
    optional={"block_size": sometimes(st.sampled_from([16, 32, 64])),
              "sliding_window": sometimes(small)})
engine = st.fixed_dictionaries({}, optional={
    "block_size": sometimes(st.sampled_from([16, 32, 64, 1536])),
    "prefix_match_unit": sometimes(st.sampled_from([16, 64, 128])),
    "kv_groups": sometimes(st.lists(group, min_size=1, max_size=3)),
    "speculative": sometimes(st.fixed_dictionaries(
        {"method": sometimes(st.sampled_from(["eagle", "mtp"]))},
        optional={"num_speculative_tokens": sometimes(st.integers(1, 4)),
                  "disable_lookahead_block_hashes": sometimes(bools)})),
    "max_model_len": sometimes(st.one_of(small, ints)), "num_gpu_blocks": sometimes(ints),
    "max_num_batched_tokens": sometimes(st.one_of(small, ints)),
    "max_num_seqs": sometimes(st.integers(1, 64)), "hash_seed": sometimes(st.one_of(
        st.none(), st.integers(0, 99), texts)), "vocab_size": sometimes(ints),
    "async_scheduling": sometimes(bools), "enable_prefix_caching": sometimes(bools),
    "scheduling_policy": sometimes(st.sampled_from(["fcfs", "priority"])),
    "connector": sometimes(st.sampled_from(["mooncake_store"])),
    "connector_config": sometimes(st.dictionaries(st.sampled_from(
        ["load_async", "cache_prefix", "enable_lookup", "kv_role"]), scalars, max_size=2)),
    "prefill_instance": sometimes(st.dictionaries(st.sampled_from(
        ["connector_config", "kv_role"]), st.one_of(scalars, st.dictionaries(
            st.sampled_from(["kv_role", "enable_lookup"]), scalars, max_size=2)),
        max_size=2)),
    "mamba_cache_mode": sometimes(st.sampled_from(["align", "none"])),
    "prefix_cache_retention_interval": sometimes(st.one_of(st.none(), small))})
event_row = st.fixed_dictionaries({"action": sometimes(st.sampled_from(
    ["reset_prefix_cache", "abort"]))}, optional={"after": sometimes(keys),
                                                  "at_step": sometimes(st.integers(0, 9)),
                                                  "target": sometimes(keys)})
scenario = st.fixed_dictionaries(
    {"requests": sometimes(st.lists(request, min_size=1, max_size=4))},
    optional={"engine": sometimes(engine), "events": sometimes(st.lists(event_row, max_size=3)),
              "expect": sometimes(st.dictionaries(keys, st.dictionaries(st.sampled_from(
                  ["num_cached_tokens", "num_prompt_tokens", "cached"]), ints), max_size=3)),
              "description": anything})
YAML_CHARS = "{}[],:&*!|>-?#'\" \n\tabsl0123456789.e+~<=%@`\x00\x07\xff"
raw_yaml = st.text(alphabet=YAML_CHARS, max_size=300)


def _dump(data) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError, OverflowError):
        assume(False)
        raise AssertionError("unreachable")


def _bounded(load):
    """``load()`` ends in a result or one TraceError line, within the time bound."""
    t0 = time.monotonic()
    try:
        result = load()
    except TraceError as exc:
        result = exc
        assert str(exc).strip(), "an empty error message"
        event("refused: " + str(exc.message).split(" ")[0][:30])
    else:
        event("loaded")
    assert time.monotonic() - t0 < EXAMPLE_SECONDS, "took too long"
    return result


@pytest.fixture(scope="module")
def peak_memory():
    """The fuzzing must not raise the process's peak memory by more than 1.5 GiB."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < 1.5 * (1 << 30), f"peak memory grew by {grown >> 20} MiB"


def _compile_and_roundtrip(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "s.yaml"
        src.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "replace"))
        trace = _bounded(lambda: compile_scenario(src))
        if isinstance(trace, TraceError):
            return
        out = _bounded(lambda: read_trace(write_trace(trace, Path(tmp) / "t")))
        assert not isinstance(out, TraceError), f"a compiled trace does not read back: {out}"
        assert out.requests.num_rows == trace.requests.num_rows
        trace.engine.sized_for(max(trace.requests["num_prompt_tokens"].to_pylist()) + 1)


@given(scenario)
def test_scenario_structures(peak_memory, data):
    _compile_and_roundtrip(_dump(data))


@given(raw_yaml)
def test_scenario_raw_text(peak_memory, text):
    _compile_and_roundtrip(text)


@given(st.sampled_from(["a", "b", "c"]), st.integers(1, 12), st.sampled_from(
    ["description", "output_len", "after", "engine", "requests"]))
def test_scenario_aliases(peak_memory, name, depth, field):
    """Nested aliases of every size land in every field: refused or loaded, quickly."""
    lines = [f"x0: &x0 [{name}, {name}, {name}, {name}, {name}, {name}, {name}, {name}]"]
    lines += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 8) + "]" for i in range(1, depth)]
    bomb = f"*x{depth - 1}"
    body = {"description": f"description: {bomb}\nrequests: [{{id: a, prompt: {{stream: s, len: 3}}}}]",
            "output_len": f"requests: [{{id: a, prompt: {{stream: s, len: 3}}, output_len: {bomb}}}]",
            "after": f"requests: [{{id: a, after: {bomb}, prompt: {{stream: s, len: 3}}}}]",
            "engine": f"engine: {{kv_groups: {bomb}}}\nrequests: [{{id: a, prompt: {{stream: s, len: 3}}}}]",
            "requests": f"requests: {bomb}"}[field]
    _compile_and_roundtrip("\n".join(lines) + "\n" + body + "\n")


# --- trace directories -----------------------------------------------------------------

@pytest.fixture(scope="module")
def base_trace(tmp_path_factory):
    return make_trace_dir(tmp_path_factory.mktemp("fuzz"), "base", SMALL_SCENARIO)


int64s = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from(
    [v for v in EXTREME if -2**63 <= v < 2**63]))
VALUES = {pa.int64(): int64s, pa.int32(): st.integers(-2**31, 2**31 - 1), pa.string(): texts,
          pa.list_(pa.int32()): st.lists(st.integers(-2**31, 2**31 - 1), max_size=6),
          pa.list_(pa.int64()): st.lists(int64s, max_size=6),
          pa.float64(): st.floats(), pa.bool_(): bools}
typed_column = st.sampled_from(list(VALUES)).flatmap(lambda t: st.tuples(
    st.just(t), st.lists(st.one_of(st.none(), VALUES[t]), min_size=3, max_size=3)))


@given(st.sampled_from(["id", "arrival_step", "after", "num_prompt_tokens", "prompt_tokens",
                        "output_len", "cache_salt", "priority", "prompt_block_ids", "bogus"]),
       typed_column, st.one_of(st.none(), engine, anything))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
def test_trace_tables(peak_memory, base_trace, column, typed, header_engine):
    typ, values = typed
    array = pa.array(values, type=typ)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp) / "t"
        t.mkdir()
        for f in base_trace.iterdir():
            if f.is_file():
                (t / f.name).write_bytes(f.read_bytes())
        table = pq.read_table(t / "requests.parquet")
        if column in table.column_names:
            i = table.column_names.index(column)
            table = table.set_column(i, pa.field(column, typ), array)
        else:
            table = table.append_column(pa.field(column, typ), array)
        pq.write_table(table, t / "requests.parquet")
        if header_engine is not None:
            header = json.loads((t / "header.json").read_text())
            header["engine"] = header_engine
            (t / "header.json").write_text(json.dumps(header, allow_nan=True))
        _bounded(lambda: read_trace(t))


@given(anything)
def test_header_json(peak_memory, header):
    with tempfile.TemporaryDirectory() as tmp:
        t = make_trace_dir(Path(tmp), "t", SMALL_SCENARIO)
        (t / "header.json").write_text(json.dumps(header, allow_nan=True))
        _bounded(lambda: read_trace(t))


# --- Mooncake JSONL --------------------------------------------------------------------

mooncake_line = st.one_of(
    st.fixed_dictionaries({"timestamp": sometimes(st.just(0)),
                           "input_length": sometimes(st.one_of(st.integers(1, 600), ints)),
                           "output_length": sometimes(st.integers(0, 5)),
                           "hash_ids": sometimes(st.lists(int64s, min_size=1, max_size=4))}),
    anything)


@given(st.lists(st.one_of(mooncake_line.map(lambda r: json.dumps(r, allow_nan=True)),
                          st.text(alphabet='{}[]:,"0123456789-e. \x00\xff', max_size=60)),
                min_size=1, max_size=5))
def test_mooncake_lines(peak_memory, lines):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.jsonl"
        src.write_text("".join(line + "\n" for line in lines), encoding="utf-8",
                       errors="surrogateescape")
        trace = _bounded(lambda: import_mooncake(src))
        if not isinstance(trace, TraceError):
            out = _bounded(lambda: read_trace(write_trace(trace, Path(tmp) / "t")))
            assert not isinstance(out, TraceError), out


# --- the command line, in a fresh interpreter under a memory limit ---------------------

def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY_BYTES, CLI_MEMORY_BYTES))


def _cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "_PREFIX_REPLAYER_PINNED"}
    proc = subprocess.run([sys.executable, "-m", "replayer", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_memory)
    assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    if proc.returncode == 2:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("replayer: error: "), proc.stderr
    return proc


@given(st.one_of(scenario.map(_dump), raw_yaml))
@settings(max_examples=CLI_EXAMPLES)
def test_cli_compile_and_info(text):
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "s.yaml").write_text(text, encoding="utf-8", errors="replace")
        proc = _cli("compile", "s.yaml", "-o", "out", cwd=tmp)
        if proc.returncode == 0:
            _cli("info", "out", cwd=tmp)


@given(st.lists(mooncake_line.map(lambda r: json.dumps(r, allow_nan=True)), min_size=1,
                max_size=4))
@settings(max_examples=CLI_EXAMPLES)
def test_cli_import(lines):
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "m.jsonl").write_text("".join(line + "\n" for line in lines))
        _cli("import", "mooncake", "m.jsonl", "-o", "out", cwd=tmp)


def test_profile_is_bounded_and_seeded():
    """``make test`` runs a fixed, bounded sample (the long profile is for local runs)."""
    if PROFILE == "ci":
        assert settings().derandomize and settings().max_examples <= 200
    assert REPO.is_dir()
