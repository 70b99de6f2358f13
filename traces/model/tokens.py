"""Deterministic token synthesis.

Token ``i`` of stream ``s`` is a fixed function of ``(s, i)``: the same span in
two requests is the same tokens, in any process, whatever PYTHONHASHSEED says.
Everything is vectorised with numpy (a per-block Python loop costs ~10 s over
the Mooncake conversation trace).
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BLOCK_DOMAIN = np.uint64(0xB10C_B10C_5EED_0001)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def stream_seed(name: str) -> int:
    """A stable 64-bit seed for a named stream (sha256, not Python's hash)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def stream_tokens(name: str, start: int, length: int, vocab_size: int) -> np.ndarray:
    """Tokens ``start .. start+length-1`` of stream ``name`` as int64."""
    seed = np.uint64(stream_seed(name))
    pos = np.arange(start, start + length, dtype=np.uint64)
    with np.errstate(over="ignore"):
        out = mix(seed + (pos + np.uint64(1)) * _GOLDEN)
    return (out % np.uint64(vocab_size)).astype(np.int64)


def block_tokens(block_ids: np.ndarray | list[int], block_size: int, length: int,
                 vocab_size: int) -> np.ndarray:
    """Tokens of a prompt named by block ids, cut to ``length``.

    Each block's tokens depend on its id alone, so equal ids at equal positions
    give equal prefixes, exactly as in an anonymised production trace.
    """
    # Only the blocks the prompt reaches: extra ids would cost block_size tokens each.
    ids = np.asarray(block_ids, dtype=np.int64)[: -(-length // block_size)].astype(np.uint64)
    with np.errstate(over="ignore"):
        seeds = mix(ids ^ _BLOCK_DOMAIN)
        pos = np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN
        out = mix(seeds[:, None] + pos[None, :]).reshape(-1)[:length]
    return (out % np.uint64(vocab_size)).astype(np.int64)
