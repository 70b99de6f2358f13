"""A streamed read (``read_trace(stream=True)``, what ``run`` does on the installed
vLLM) leaves the requests table's lists in the file and reads them batch by
batch: the same tokens, the same replay bytes and the same errors as a whole
read, holding only the rows not yet handed to the engine."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TRACES, cli
from traces import TraceError, read_trace, write_trace
from traces.io import request_stream
from traces.materialize import TokenSource
from traces.scenarios.compile import compile_scenario

VOCAB = 32000


def _small_batches(monkeypatch, rows: int = 7) -> None:
    monkeypatch.setattr(request_stream, "MIN_BATCH_ROWS", rows)
    monkeypatch.setattr(request_stream, "MAX_BATCH_ROWS", rows)


def _rewrite_requests(trace_dir, table: pa.Table, row_group_size: int = 50) -> None:
    """The requests table as several row groups (a written trace has one)."""
    pq.write_table(table, trace_dir / "requests.parquet", row_group_size=row_group_size)


def _every_list_column(tmp_path):
    """conversation_500 with explicit prompt tokens on every third row and output
    tokens on every other one, nulls elsewhere: all three list columns."""
    src = read_trace(TRACES / "conversation_500")
    rq = src.requests
    n = rq.num_rows
    npt = rq["num_prompt_tokens"].to_pylist()
    olen = rq["output_len"].to_pylist()
    prompt = [[(i * 7 + k) % VOCAB for k in range(npt[i])] if i % 3 == 0 else None
              for i in range(n)]
    out = [[(i + k) % VOCAB for k in range(olen[i])] if i % 2 == 0 else None for i in range(n)]
    rq = rq.append_column(pa.field("prompt_tokens", pa.list_(pa.int32())),
                          pa.array(prompt, pa.list_(pa.int32())))
    rq = rq.append_column(pa.field("output_tokens", pa.list_(pa.int32())),
                          pa.array(out, pa.list_(pa.int32())))
    out_dir = write_trace(src, tmp_path / "t")
    _rewrite_requests(out_dir, rq)
    return out_dir


def _tokens(source: TokenSource, rows, olen) -> list:
    got = []
    for i in rows:
        blocks = source.prompt_blocks(i)
        got.append((source.prompt(i).tolist(), blocks,
                    source.output(i, olen[i], 2).tolist()))
        source.release(i)
    return got


def test_streamed_tokens_equal_whole_in_any_order(tmp_path, monkeypatch):
    _small_batches(monkeypatch)
    path = _every_list_column(tmp_path)
    whole = read_trace(path)
    streamed = read_trace(path, stream=True)
    assert whole.request_lists is None and streamed.request_lists is not None
    assert "prompt_block_ids" not in streamed.requests.column_names
    assert set(streamed.request_lists.names) == {"prompt_tokens", "prompt_block_ids",
                                                 "output_tokens"}
    n = whole.requests.num_rows
    olen = whole.requests["output_len"].to_pylist()
    # Arrival order, then an order with rows far behind the reader (late arrivals).
    rng = np.random.default_rng(0)
    for order in (list(range(n)), [int(i) for i in rng.permutation(n)]):
        a = _tokens(TokenSource(whole.header, whole.requests), order, olen)
        b = _tokens(TokenSource(streamed.header, streamed.requests, streamed.request_lists),
                    order, olen)
        assert a == b
        assert any(x[1] is None for x in a) and any(x[1] is not None for x in a)


def test_window_holds_only_unreleased_rows(tmp_path, monkeypatch):
    _small_batches(monkeypatch)
    path = _every_list_column(tmp_path)
    lists = read_trace(path, stream=True).request_lists
    window = lists.window()
    held = []
    for i in range(lists.num_rows):                 # in order: about one batch at a time
        window.get("prompt_block_ids", i)
        window.release(i)
        held.append(sum(len(c.rows) for c in window._chunks))
    assert max(held) <= 7 and held[-1] == 0
    window.close()
    window = lists.window()
    window.get("output_tokens", 3)                  # row 3 arrives last
    for i in range(lists.num_rows):
        if i != 3:
            window.get("prompt_block_ids", i)
            window.release(i)
    # Its batch was compacted to it alone once passed.
    assert [c.rows.tolist() for c in window._chunks] == [[3]]
    window.release(3)
    with pytest.raises(LookupError):
        window.get("prompt_block_ids", 3)
    window.close()


SCENARIO = """\
description: streamed and whole replays agree (several batches, after chains, events)
engine:
  block_size: 16
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 256
requests:
"""


def _scenario(tmp_path):
    """40 requests: timed ones out of row order, an after chain whose head is a
    late row, shared prefixes; an abort, an evict, and a reset once all is idle
    before the last request."""
    lines = []
    for i in range(40):
        head = f"  - {{id: r{i}, prompt: [{{stream: doc, len: {200 + 37 * (i % 5)}}}, " \
               f"{{stream: u{i % 9}, len: {40 + i}}}], output_len: {3 + i % 4}"
        if i in (2, 3, 4):
            lines.append(head + f", after: r{i + 30 if i == 2 else i - 1}}}")
        else:
            lines.append(head + f", arrival_step: {401 if i == 39 else (i * 13) % 60}}}")
    events = ("events:\n"
              "  - {at_step: 400, action: reset_prefix_cache}\n"
              "  - {at_step: 3, action: abort, target: r37}\n"
              "  - {after: r33, action: evict, request: r5}\n")
    path = tmp_path / "streamed.yaml"
    path.write_text(SCENARIO + "\n".join(lines) + "\n" + events)
    trace = compile_scenario(path)
    out = write_trace(trace, tmp_path / "streamed_trace")
    _rewrite_requests(out, pq.read_table(out / "requests.parquet"), row_group_size=6)
    return out


def test_streamed_replay_is_the_same_bytes(tmp_path, monkeypatch):
    """Several row groups and batches, an after chain through a late row, events:
    the streamed replay writes the whole replay's --json bytes."""
    from replayer.replay.loop import replay
    from replayer.check.output import JsonStream, dumps
    from replayer.replay.execution.in_process import engine_here

    _small_batches(monkeypatch, 5)
    path = _scenario(tmp_path)
    whole = read_trace(path)
    assert whole.events is not None and whole.requests["after"].null_count < 40
    with engine_here(whole) as adapter:
        expected = dumps(replay(whole, adapter))
    streamed = read_trace(path, stream=True)
    assert streamed.request_lists is not None
    out = io.StringIO()
    with engine_here(streamed) as adapter:
        stream = JsonStream(out, adapter.info)
        stream.finish(replay(streamed, adapter, sink=stream))
    assert out.getvalue() == expected
    assert '"aborted": true' in expected


def _bad_deep_row(tmp_path, column: str, value) -> tuple:
    """conversation_500 (several row groups) with one bad value in row 431."""
    src = read_trace(TRACES / "conversation_500")
    rq = src.requests
    col = rq[column].to_pylist()
    col[431] = value
    rq = rq.set_column(rq.column_names.index(column), rq.schema.field(column),
                       pa.array(col, rq.schema.field(column).type))
    out = write_trace(src, tmp_path / f"bad_{column}")
    _rewrite_requests(out, rq)
    return out


@pytest.mark.parametrize("column,value", [("prompt_block_ids", [1, 2]),
                                          ("num_prompt_tokens", 0)])
def test_bad_row_in_a_later_batch_is_one_line_and_nothing_written(tmp_path, column, value):
    path = _bad_deep_row(tmp_path, column, value)
    with pytest.raises(TraceError) as whole:
        read_trace(path)
    with pytest.raises(TraceError) as streamed:
        read_trace(path, stream=True)
    assert str(streamed.value) == str(whole.value)
    assert streamed.value.row == 431 and streamed.value.column == column
    out = tmp_path / "out.json"
    got = cli("run", path, "--json", out, "--no-progress")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [f"replayer: error: {whole.value}"]
    assert not out.exists()


def test_streamed_errors_are_the_whole_reads_first_error(tmp_path):
    """Two bad rows: a list-column error early, a scalar error late; the whole read
    reports the scalar check's (it runs first), and so does the streamed read."""
    src = read_trace(TRACES / "conversation_500")
    rq = src.requests
    blocks = rq["prompt_block_ids"].to_pylist()
    blocks[5] = [1]                                  # fewer blocks than tokens, row 5
    out_len = rq["output_len"].to_pylist()
    out_len[480] = 0                                 # output_len below 1, row 480
    rq = rq.set_column(rq.column_names.index("prompt_block_ids"),
                       rq.schema.field("prompt_block_ids"),
                       pa.array(blocks, pa.list_(pa.int64())))
    rq = rq.set_column(rq.column_names.index("output_len"), rq.schema.field("output_len"),
                       pa.array(out_len, pa.int64()))
    path = write_trace(src, tmp_path / "two_bad")
    _rewrite_requests(path, rq)
    with pytest.raises(TraceError) as whole:
        read_trace(path)
    with pytest.raises(TraceError) as streamed:
        read_trace(path, stream=True)
    assert whole.value.row == 480
    assert str(streamed.value) == str(whole.value)


def test_a_file_changed_after_the_read_is_an_error_not_other_tokens(tmp_path):
    """A streamed trace reads its requests file again when it replays: a file
    replaced in between (another trace written over it) is refused, naming it."""
    trace_dir = write_trace(read_trace(TRACES / "conversation_500"), tmp_path / "t")
    trace = read_trace(trace_dir, stream=True)
    assert trace.request_lists is not None
    table = pq.read_table(trace_dir / "requests.parquet")
    pq.write_table(table.slice(0, 10), trace_dir / "requests.parquet")
    source = TokenSource(trace.header, trace.requests, trace.request_lists)
    with pytest.raises(TraceError, match="requests.parquet.*changed since the trace was read"):
        source.prompt(0)
