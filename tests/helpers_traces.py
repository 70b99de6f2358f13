"""Helpers shared by the trace and CLI-error tests (no fixtures: plain functions)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import MOONCAKE_TRACE, REPO, cli  # noqa: F401 - shared with the tests

# A small scenario touching every scenario feature that compiles to a table:
# several spans, after/arrival_step, cache_salt, events and goldens.
SMALL_SCENARIO = """\
description: small round-trip scenario
engine:
  block_size: 16
  max_num_seqs: 4
requests:
  - id: a
    prompt: [{stream: doc, start: 0, len: 40}, {stream: q1, len: 7}]
    output_len: 3
  - id: b
    after: a
    prompt: [{stream: doc, start: 0, len: 40}, {stream: q2, start: 5, len: 9}]
    output_len: 2
    cache_salt: salty
  - id: c
    arrival_step: 4
    prompt: {stream: other, len: 33}
events:
  - {after: a, action: reset_prefix_cache}
expect:
  b: {num_cached_tokens: 32, num_prompt_tokens: 49}
  c: {num_cached_tokens: 0}
"""


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def write_jsonl(path: Path, records: Iterable[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def make_trace_dir(tmp: Path, name: str = "trace", scenario: str = SMALL_SCENARIO) -> Path:
    """Compile ``scenario`` into ``tmp/name`` through the library (no subprocess)."""
    from traces.scenarios.compile import compile_scenario
    from traces.trace import write_trace

    src = write_text(tmp / f"{name}.yaml", scenario)
    return write_trace(compile_scenario(src), tmp / name)


def rewrite_requests(trace_dir: Path, change) -> None:
    """Replace requests.parquet by ``change(table)`` (raw pyarrow: no validation)."""
    path = trace_dir / "requests.parquet"
    table = pq.read_table(path)
    pq.write_table(change(table), path)


def replace_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, pa.field(name, array.type, nullable=True), array)


def assert_bad_input(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, nothing on stdout, one ``replayer: error:`` line naming every needle."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("replayer: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert proc.stdout == "", proc.stdout
    return line


def listing(folder: Path) -> set[str]:
    """Every name under ``folder``, recursively, hidden ones included."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}
