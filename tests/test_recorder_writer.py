"""The crash-safe part writer and the part-aware reader (no vLLM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from traces.model import schema
from traces.model.errors import TraceError
from traces.trace import read_trace
from traces.io.parts import PartWriter, pack_tokens, part_name

from conftest import REPO, cli

HEADER = {"schema_version": 1, "engine": {"block_size": 16},
          "source": {"kind": "recorded"}}


def _request(i: int, order: int) -> dict:
    return {"id": f"r{i}", "arrival_step": i // 3, "num_prompt_tokens": 4,
            "prompt_tokens": [i % 100, 1, 2, 3], "output_len": 1, "output_tokens": [7],
            "arrival_order": order}


def _trace_dir(tmp_path: Path) -> Path:
    out = tmp_path / "rec"
    out.mkdir()
    (out / "header.json").write_text(json.dumps(HEADER))
    return out


def test_parts_merge_in_order_and_requests_sort_by_arrival(tmp_path):
    out = _trace_dir(tmp_path)
    w = PartWriter(out, schema.REQUESTS, max_rows=4)
    # Written as they finish (reverse), read in arrival order.
    for i in reversed(range(10)):
        w.append(_request(i, order=i))
    w.close()
    assert w.parts_written == 3
    assert sorted(p.name for p in (out / "requests").iterdir()) == [
        part_name(0, 0), part_name(0, 1), part_name(0, 2)]
    trace = read_trace(out)
    assert trace.requests["id"].to_pylist() == [f"r{i}" for i in range(10)]
    assert trace.skipped_parts == []


def test_packed_and_listed_tokens_and_step_batches_read_back_alike(tmp_path):
    out = _trace_dir(tmp_path)
    w = PartWriter(out, schema.REQUESTS)
    w.append({**_request(0, 0), "prompt_tokens": pack_tokens([5, 2**31 - 1, 0]),
              "num_prompt_tokens": 3})
    w.append({**_request(1, 1), "prompt_tokens": None})
    w.append({**_request(2, 2), "prompt_tokens": pack_tokens([]), "num_prompt_tokens": 0})
    w.close()
    fin = PartWriter(out, schema.FINISHES)
    fin.append({"id": "r0", "output_len": 2, "output_tokens": pack_tokens([9, 8])})
    fin.append({"id": "r1", "output_len": 1, "output_tokens": None})
    fin.append({"id": "r2", "output_len": 1, "output_tokens": [7]})
    fin.close()
    steps = PartWriter(out, schema.STEPS)
    steps.extend({"step": 4, "id": ["a", "b"], "num_scheduled_tokens": [3, 1]}, 2)
    steps.append({"step": 5, "id": "a", "num_scheduled_tokens": 1, "num_accepted_tokens": 0})
    steps.extend({"step": 6, "id": ["b"], "num_scheduled_tokens": [2],
                  "num_accepted_tokens": [1]}, 1)
    steps.extend({"step": 7, "id": [], "num_scheduled_tokens": []}, 0)
    steps.close()
    rq = pq.read_table(out / "requests" / part_name(0, 0))
    assert rq["prompt_tokens"].to_pylist() == [[5, 2**31 - 1, 0], None, []]
    fin = pq.read_table(out / "finishes" / part_name(0, 0))
    assert fin["output_tokens"].to_pylist() == [[9, 8], None, [7]]
    st = pq.read_table(out / "steps" / part_name(0, 0)).to_pylist()
    assert [(r["step"], r["id"], r["num_scheduled_tokens"], r["num_accepted_tokens"])
            for r in st] == [(4, "a", 3, None), (4, "b", 1, None), (5, "a", 1, 0), (6, "b", 2, 1)]


def test_time_based_flush_writes_a_part_without_more_rows(tmp_path):
    out = _trace_dir(tmp_path)
    w = PartWriter(out, schema.STEPS, max_rows=1000, max_seconds=0.2)
    w.append({"step": 0, "id": "a", "num_scheduled_tokens": 5, "num_accepted_tokens": None})
    deadline = time.monotonic() + 5
    while not list((out / "steps").glob("part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pq.read_table(out / "steps" / part_name(0, 0)).num_rows == 1
    w.close()


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    out = _trace_dir(tmp_path)
    w = PartWriter(out, schema.STEPS)
    w.append({"step": 0, "id": "a", "num_scheduled_tokens": 5, "num_accepted_tokens": None})
    w.close()
    with pytest.raises(TraceError, match="already holds parts of rank 0"):
        PartWriter(out, schema.STEPS)
    PartWriter(out, schema.STEPS, rank=1).close()          # another rank is fine


WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from traces.model import schema
    from traces.io.parts import PartWriter
    w = PartWriter({out!r}, schema.REQUESTS, max_rows=50)
    i = 0
    while True:
        w.append({{"id": f"r{{i}}", "arrival_step": i, "num_prompt_tokens": 3,
                   "prompt_tokens": [1, 2, 3], "output_len": 1, "output_tokens": [4],
                   "arrival_order": i}})
        i += 1
        if i % 50 == 0:
            time.sleep(0.002)
""")


def test_kill_9_leaves_only_whole_parts_and_a_half_written_one_is_skipped(tmp_path):
    out = _trace_dir(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c",
                             WRITER_SCRIPT.format(repo=str(REPO), out=str(out))])
    try:
        deadline = time.monotonic() + 60
        while len(list((out / "requests").glob("part-*.parquet"))) < 5:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # What a kill during a write leaves: a temporary part, cut short.
    whole = sorted((out / "requests").glob("part-*.parquet"))[0].read_bytes()
    half = out / "requests" / f".{part_name(0, 999999)}.tmp"
    half.write_bytes(whole[: len(whole) // 2])
    trace = read_trace(out)
    n = trace.requests.num_rows
    assert n >= 250 and n % 50 == 0                      # whole parts only
    assert trace.requests["id"].to_pylist() == [f"r{i}" for i in range(n)]   # no gap
    assert str(half) in trace.skipped_parts
    proc = cli("info", out)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped half-written part: {half}" in proc.stdout
    assert f"requests: {n} rows" in proc.stdout


def test_stray_file_and_both_forms_are_errors(tmp_path):
    out = _trace_dir(tmp_path)
    w = PartWriter(out, schema.REQUESTS)
    w.append(_request(0, 0))
    w.close()
    (out / "requests" / "notes.txt").write_text("x")
    with pytest.raises(TraceError, match="not a part of the requests table"):
        read_trace(out)
    (out / "requests" / "notes.txt").unlink()
    pq.write_table(pq.read_table(out / "requests" / part_name(0, 0)), out / "requests.parquet")
    with pytest.raises(TraceError, match="a table is one or the other"):
        read_trace(out)


def test_finishes_fold_into_requests_and_running_ones_end_with_the_recording(tmp_path):
    out = _trace_dir(tmp_path)
    rq = PartWriter(out, schema.REQUESTS)
    for i in range(3):
        rq.append({"id": f"r{i}", "arrival_step": i, "num_prompt_tokens": 2,
                   "prompt_tokens": pack_tokens([i, 1]), "output_len": 50, "arrival_order": i})
    rq.close()
    fin = PartWriter(out, schema.FINISHES)
    fin.append({"id": "r0", "output_len": 2, "output_tokens": pack_tokens([7, 8])})
    fin.append({"id": "gone", "output_len": 1, "output_tokens": pack_tokens([9])})
    fin.close()
    steps = PartWriter(out, schema.STEPS)
    steps.extend({"step": 7, "id": ["r1", "r2"], "num_scheduled_tokens": [1, 1]}, 2)
    steps.close()
    trace = read_trace(out)
    assert trace.requests["output_len"].to_pylist() == [2, 50, 50]
    assert trace.requests["output_tokens"].to_pylist() == [[7, 8], None, None]
    assert trace.events.to_pylist() == [
        {"after": None, "at_step": 8, "action": "abort", "target": "r1", "group": None,
         "keys": None, "op": None, "code": None, "times": None},
        {"after": None, "at_step": 8, "action": "abort", "target": "r2", "group": None,
         "keys": None, "op": None, "code": None, "times": None}]
    assert any("2 request(s) still running" in n and "step 8" in n for n in trace.notes)
    assert any("1 finish row(s)" in n for n in trace.notes)
    proc = cli("info", out)
    assert proc.returncode == 0, proc.stderr
    assert "note: 2 request(s) still running when the recording ended" in proc.stdout


@pytest.mark.parametrize("raw, needle", [("soon", "expected seconds, e.g. 2.5"),
                                         ("0", "must be above 0"), ("-1", "must be above 0")])
def test_a_bad_flush_interval_is_refused_naming_the_variable(monkeypatch, raw, needle):
    from replayer.recorder.session import FLUSH_ENV, writer_options

    monkeypatch.setenv(FLUSH_ENV, raw)
    with pytest.raises(ValueError, match=f"PREFIX_REPLAYER_RECORD_FLUSH_SECONDS='{raw}': {needle}"):
        writer_options()
    monkeypatch.setenv(FLUSH_ENV, "0.5")
    assert writer_options() == {"max_seconds": 0.5}


def test_external_id_is_the_front_ends_id_without_vllms_random_suffix(monkeypatch):
    from replayer.recorder.scheduler import external_id

    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    assert external_id("cmpl-r0002-0-9038f593") == "cmpl-r0002-0"
    assert external_id("chatcmpl-3f2a-0b1c2d3e") == "chatcmpl-3f2a"
    assert external_id("turn1") is None                    # added to the engine directly
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_id("cmpl-r0002-0") == "cmpl-r0002-0"


def test_parts_say_through_which_step_every_table_was_on_disk(tmp_path):
    """Each part carries, for every table of the recording, the step through which
    that table's rows were on disk; without recording-end.json the reader takes
    the least of the latest as the cut. A table whose buffer is empty counts as
    whole up to the watermark; one holding rows, only up to its last part."""
    out = _trace_dir(tmp_path)
    clock = {"done": -1}
    writers: dict[str, PartWriter] = {}

    def durable_map(writer, mark):
        now = clock["done"]
        return {n: w.durable_now(now) for n, w in writers.items() if w is not writer}

    opts = {"watermark": lambda: clock["done"], "durable_map": durable_map}
    writers["requests"] = req = PartWriter(out, schema.REQUESTS, **opts)
    writers["events"] = PartWriter(out, schema.EVENTS, **opts)     # never a row
    writers["outcomes"] = oc = PartWriter(out, schema.OUTCOMES, **opts)
    for step in range(6):
        req.append(_request(step, step))
        oc.append({"id": f"r{step}", "num_prompt_tokens": 4, "num_cached_tokens": 0,
                   "step": step})
        clock["done"] = step
        if step == 2:
            req.flush()                    # requests on disk through step 2
            oc.flush()
            # The writer thread renames the part into place on its own time; a
            # table's durable step moves only then (an in-flight part is not on disk).
            deadline = time.monotonic() + 30
            while req.durable < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert req.durable == 2
    oc.close()                             # outcomes through step 5; requests hold 3..5
    req.abandon()                          # killed: its buffer is lost
    writers["events"].abandon()
    parts = sorted((out / "outcomes").glob("part-*"))
    meta = json.loads(pq.read_schema(parts[-1]).metadata[schema.PART_DURABLE_KEY])
    assert meta == {"outcomes": 5, "requests": 2, "events": 5}
    trace = read_trace(out)
    assert trace.cut_step == 2
    assert trace.notes[0] == ("the recording was cut short (no clean stop): every table is "
                              "whole through step 2")
    (out / schema.END_FILE).write_text("{}")          # a clean stop: whole
    assert read_trace(out).cut_step is None
