"""The Mooncake importer: line numbers, the step clock, block ids and their tokens."""

from __future__ import annotations

import json

import numpy as np

from helpers_traces import MOONCAKE_TRACE, write_jsonl
from traces import read_trace, write_trace
from traces.importers.mooncake import DEFAULT_ENGINE, MOONCAKE_BLOCK_TOKENS, import_mooncake
from traces.materialize import TokenSource

B = MOONCAKE_BLOCK_TOKENS

SMALL = [
    {"timestamp": 0, "input_length": 1400, "output_length": 7, "hash_ids": [1, 2, 3]},
    {"timestamp": 19, "input_length": 1500, "output_length": 0, "hash_ids": [1, 2, 4]},
    {"timestamp": 20, "input_length": 600, "output_length": 3, "hash_ids": [1, 5]},
    {"timestamp": 45, "input_length": 100, "output_length": 1, "hash_ids": [9]},
    {"timestamp": 1000, "input_length": 512, "output_length": 2, "hash_ids": [2]},
]


def test_small_import(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", SMALL)
    trace = import_mooncake(src)
    rq = trace.requests
    assert rq["id"].to_pylist() == ["0", "1", "2", "3", "4"]
    assert rq["arrival_ms"].to_pylist() == [0, 19, 20, 45, 1000]
    assert rq["arrival_step"].to_pylist() == [0, 0, 1, 2, 50]
    assert rq["num_prompt_tokens"].to_pylist() == [1400, 1500, 600, 100, 512]
    assert rq["prompt_block_ids"].to_pylist() == [r["hash_ids"] for r in SMALL]
    # a zero-length output still samples one token
    assert rq["output_len"].to_pylist() == [7, 1, 3, 1, 2]
    assert "prompt_tokens" not in rq.column_names
    h = trace.header
    assert h["prompt_blocks"] == {"block_tokens": 512}
    assert h["source"]["kind"] == "imported" and h["source"]["format"] == "mooncake"
    assert h["source"]["requests"] == 5
    assert h["step_clock"] == {"step_ms": 20}
    assert h["engine"] == DEFAULT_ENGINE


def test_step_ms_and_limit(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", SMALL)
    trace = import_mooncake(src, step_ms=10, limit=3)
    assert trace.requests["id"].to_pylist() == ["0", "1", "2"]
    assert trace.requests["arrival_step"].to_pylist() == [0, 1, 2]
    assert trace.header["step_clock"] == {"step_ms": 10}
    assert trace.header["source"]["requests"] == 3


def test_shared_blocks_share_tokens(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", SMALL)
    trace = import_mooncake(src)
    ts = TokenSource(trace.header, trace.requests)
    p = [ts.prompt(i) for i in range(len(SMALL))]
    assert [len(x) for x in p] == [r["input_length"] for r in SMALL]
    for x in p:
        assert x.min() >= 0 and x.max() < 32000
    # requests 0 and 1 share two blocks: 1024 equal tokens, then different ones
    np.testing.assert_array_equal(p[0][:2 * B], p[1][:2 * B])
    assert not np.array_equal(p[0][2 * B:1400], p[1][2 * B:1400])
    assert p[0][2 * B] != p[1][2 * B] or p[0][2 * B + 1] != p[1][2 * B + 1]
    # request 2 shares only block 1 with them
    np.testing.assert_array_equal(p[0][:B], p[2][:B])
    assert not np.array_equal(p[0][B:600], p[2][B:600])
    # request 3 shares nothing
    assert not np.array_equal(p[0][:100], p[3])
    # block 2 at position 0 (request 4) is block 2's tokens, whatever came before it elsewhere
    np.testing.assert_array_equal(p[4], p[0][B:2 * B])


def test_imported_trace_round_trip(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", SMALL)
    trace = import_mooncake(src)
    back = read_trace(write_trace(trace, tmp_path / "out"))
    assert back.header == trace.header
    assert back.requests.equals(trace.requests)
    a = TokenSource(trace.header, trace.requests)
    b = TokenSource(back.header, back.requests)
    for i in range(len(SMALL)):
        np.testing.assert_array_equal(a.prompt(i), b.prompt(i))


def _shared_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_first_50_lines_of_the_conversation_trace(tmp_path):
    with MOONCAKE_TRACE.open() as fh:
        lines = [next(fh) for _ in range(50)]
    head = tmp_path / "head.jsonl"
    head.write_text("".join(lines))
    recs = [json.loads(line) for line in lines]

    trace = import_mooncake(head)
    limited = import_mooncake(MOONCAKE_TRACE, limit=50)
    assert limited.requests.equals(trace.requests)

    rq = trace.requests
    assert rq["id"].to_pylist() == [str(i) for i in range(50)]
    assert rq["arrival_ms"].to_pylist() == [r["timestamp"] for r in recs]
    assert rq["arrival_step"].to_pylist() == [r["timestamp"] // 20 for r in recs]
    assert rq["num_prompt_tokens"].to_pylist() == [r["input_length"] for r in recs]
    assert rq["prompt_block_ids"].to_pylist() == [r["hash_ids"] for r in recs]
    assert rq["output_len"].to_pylist() == [max(1, r["output_length"]) for r in recs]

    ts = TokenSource(trace.header, trace.requests)
    prompts = [ts.prompt(i) for i in range(50)]
    assert [len(p) for p in prompts] == [r["input_length"] for r in recs]
    pairs_sharing = pairs_diverging = 0
    for i in range(50):
        for j in range(i + 1, 50):
            k = _shared_prefix(recs[i]["hash_ids"], recs[j]["hash_ids"])
            n = min(len(prompts[i]), len(prompts[j]))
            same = min(k * B, n)
            np.testing.assert_array_equal(prompts[i][:same], prompts[j][:same])
            pairs_sharing += k > 0
            if same < n:
                # the first differing block gives different tokens right away
                end = min(same + B, n)
                a, b = prompts[i][same:end], prompts[j][same:end]
                assert not np.array_equal(a, b), (i, j)
                assert np.count_nonzero(a == b) < max(5, (end - same) // 100), (i, j)
                pairs_diverging += 1
    # the sample does exercise both sides of the rule
    assert pairs_sharing > 10 and pairs_diverging > 10


def test_the_bundled_slice_is_the_head_of_the_public_trace_behind_conversation_500():
    """fixtures/mooncake/ holds the first 500 lines; conversation_500 is their import."""
    from conftest import TRACES

    lines = MOONCAKE_TRACE.read_text().splitlines()
    assert len(lines) == 500
    assert json.loads(lines[0]) == {"timestamp": 0, "input_length": 6758, "output_length": 500,
                                    "hash_ids": list(range(14))}
    imported = import_mooncake(MOONCAKE_TRACE, limit=500).requests
    bundled = read_trace(TRACES / "conversation_500").requests
    for name in ("id", "arrival_step", "arrival_ms", "num_prompt_tokens", "prompt_block_ids",
                 "output_len"):
        assert imported[name].to_pylist() == bundled[name].to_pylist(), name
