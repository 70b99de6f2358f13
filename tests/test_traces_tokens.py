"""Token synthesis: a fixed function of (stream, position) or (block id, offset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from traces.model.tokens import block_tokens, stream_seed, stream_tokens

V = 32000


def test_stream_tokens_deterministic_and_positional():
    a = stream_tokens("doc", 0, 5000, V)
    b = stream_tokens("doc", 0, 5000, V)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.shape == (5000,)
    # the same span asked for in two places (two requests, two offsets) is the same tokens
    np.testing.assert_array_equal(stream_tokens("doc", 1234, 700, V), a[1234:1934])
    np.testing.assert_array_equal(stream_tokens("doc", 4999, 1, V), a[4999:])
    # not a constant or short-period sequence
    assert len(np.unique(a)) > 4000


def test_different_streams_differ():
    a = stream_tokens("doc", 0, 4096, V)
    b = stream_tokens("doc2", 0, 4096, V)
    assert not np.array_equal(a, b)
    # independent streams agree only by chance (about 1/V per position)
    assert np.count_nonzero(a == b) < 10
    # and a stream is not a shifted copy of itself
    assert np.count_nonzero(a[1:] == a[:-1]) < 10
    assert stream_seed("doc") != stream_seed("doc2")


def test_tokens_in_vocabulary():
    for vocab in (1, 2, 7, 32000, 151936, 2**31 - 1):
        s = stream_tokens("x", 0, 20000, vocab)
        assert s.min() >= 0 and s.max() < vocab, vocab
        blk = block_tokens(np.arange(40), 512, 40 * 512, vocab)
        assert blk.min() >= 0 and blk.max() < vocab, vocab
        assert blk.dtype == np.int64
    # a small vocabulary is actually used, not just the first ids
    assert set(stream_tokens("x", 0, 2000, 7).tolist()) == set(range(7))


def test_block_tokens_equal_ids_equal_tokens():
    bs = 512
    a = block_tokens([5, 6, 7], bs, 3 * bs, V)
    b = block_tokens([5, 6, 9], bs, 3 * bs, V)
    assert a.shape == (3 * bs,)
    np.testing.assert_array_equal(a[:2 * bs], b[:2 * bs])
    assert np.count_nonzero(a[2 * bs:] == b[2 * bs:]) < 5
    # a block's tokens depend on its id alone
    np.testing.assert_array_equal(block_tokens([7], bs, bs, V), a[2 * bs:])
    # each block is not a repeat of another
    assert not np.array_equal(a[:bs], a[bs:2 * bs])
    # cut to length, the rest of the last block dropped
    cut = block_tokens([5, 6, 7], bs, 2 * bs + 3, V)
    np.testing.assert_array_equal(cut, a[:2 * bs + 3])
    # numpy arrays and lists of ids give the same tokens
    np.testing.assert_array_equal(block_tokens(np.array([5, 6, 7], dtype=np.int64), bs, 3 * bs, V), a)


def test_block_tokens_wide_ids():
    ids = [0, -1, 2**63 - 1, -(2**63)]
    t = block_tokens(ids, 16, 64, V)
    assert t.shape == (64,)
    assert len({tuple(t[i * 16:(i + 1) * 16]) for i in range(4)}) == 4


def test_pinned_values():
    # The synthesis is part of the trace format: traces store block ids and spans,
    # not tokens, so changing it silently changes what every recorded trace replays.
    assert stream_tokens("doc", 0, 8, V).tolist() == [
        24577, 27999, 376, 13189, 14078, 1263, 4512, 4509]
    assert block_tokens([0, 1], 512, 1024, V)[[0, 1, 2, 511, 512, 1023]].tolist() == [
        23168, 19611, 12003, 3557, 19074, 22110]


_CHILD = (
    "import json\n"
    "from traces.model.tokens import stream_tokens, block_tokens\n"
    "print(json.dumps([stream_tokens('doc', 100, 300, 32000).tolist(),\n"
    "                  block_tokens([3, 1, 4], 512, 1500, 32000).tolist()]))\n"
)


def test_same_tokens_in_another_process_with_another_hash_seed():
    here = [stream_tokens("doc", 100, 300, V).tolist(), block_tokens([3, 1, 4], 512, 1500, V).tolist()]
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                             text=True, timeout=60, check=True)
        assert json.loads(out.stdout) == here, seed
