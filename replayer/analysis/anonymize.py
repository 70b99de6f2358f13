"""Anonymising a trace: token ids become tokens derived from chained block hashes.

Each request's full token sequence (prompt, then output) is cut into chunks of
``unit`` tokens; chunk *i*'s id is a keyed hash of chunk *i-1*'s id and chunk
*i*'s tokens, so two requests share a chunk id exactly when they share every
token up to the end of that chunk. The prompt is stored as those ids
(``prompt_block_ids``) and the output as the tokens the same ids synthesise
(:func:`traces.model.tokens.block_tokens`). With ``unit`` dividing every block size
and the prefix-match unit, every block hash vLLM computes is equal between two
anonymised requests exactly when it was equal between the originals, so the
anonymised trace replays to the same hits; store keys (hashes of the real
tokens) are dropped, since the replay computes new ones.

The hash key is random unless ``secret`` is given: without it nobody can test
a guessed text against the ids.
"""

from __future__ import annotations

import hashlib
import os
from functools import reduce
from math import gcd

import numpy as np
import pyarrow as pa

from traces import Trace
from traces.model.engine_spec import EngineBlock
from traces.materialize import TokenSource
from traces.model.tokens import block_tokens

ID_MASK = (1 << 63) - 1


def lookahead_tokens(engine: EngineBlock) -> int:
    """Tokens after each block that vLLM (0.33 on) folds into the block's hash.

    EAGLE's lookahead block hashes (on unless disabled, and off with a KV
    connector or without prefix caching) cover the next token, so whether a
    block hits depends on one token past it; MTP's multi-module chains read
    ``num_speculative_tokens`` ahead. Mirrors ``VllmConfig.num_hash_lookahead_tokens``.
    """
    spec = engine.speculative
    if (spec is None or spec.disable_lookahead_block_hashes or engine.connector
            or not engine.enable_prefix_caching):
        return 0
    return spec.num_speculative_tokens if spec.method == "mtp" else 1


def default_unit(engine: EngineBlock) -> int:
    """The largest chunk that divides every block size, the prefix-match unit and,
    with lookahead hashes, the offset of the lookahead tokens past each block:
    a chunk boundary must fall everywhere a hash of vLLM's ends, or two
    anonymised prompts could differ where the originals agreed."""
    sizes = [engine.block_size, *(g.block_size for g in engine.kv_groups)]
    if engine.prefix_match_unit:
        sizes.append(engine.prefix_match_unit)
    ahead = lookahead_tokens(engine)
    if ahead:
        sizes.append(ahead)
    return reduce(gcd, sizes)


def chunk_ids(tokens: np.ndarray, unit: int, key: bytes) -> list[int]:
    data = np.asarray(tokens, dtype="<i4").tobytes()
    step = 4 * unit
    ids = []
    prev = b""
    for off in range(0, len(data), step):
        prev = hashlib.blake2b(prev + data[off:off + step], digest_size=8, key=key).digest()
        ids.append(int.from_bytes(prev, "little") & ID_MASK)
    return ids


def anonymize(trace: Trace, unit: int | None = None, secret: bytes | None = None) -> Trace:
    engine = trace.engine
    unit = unit or default_unit(engine)
    key = secret if secret is not None else os.urandom(32)
    vocab = engine.vocab_size
    rq = trace.requests
    src = TokenSource(trace.header, rq)
    out_len = rq["output_len"].to_pylist()
    n_prompt = rq["num_prompt_tokens"].to_pylist()
    has_out = "output_tokens" in rq.column_names
    block_ids, outputs = [], []
    for i in range(rq.num_rows):
        prompt = src.prompt(i)
        out = src.output(i, out_len[i], 0)[: out_len[i]] if has_out else np.zeros(0, np.int64)
        ids = chunk_ids(np.concatenate([prompt, out]), unit, key)
        n_p = -(-n_prompt[i] // unit)
        block_ids.append(ids[:n_p])
        if has_out:
            full = block_tokens(ids, unit, n_prompt[i] + out_len[i], vocab)
            outputs.append(full[n_prompt[i]:].tolist())
    table = rq.drop_columns([c for c in ("prompt_tokens", "prompt_block_ids", "output_tokens")
                             if c in rq.column_names])
    table = table.append_column(pa.field("prompt_block_ids", pa.list_(pa.int64()), nullable=True),
                                pa.array(block_ids, pa.list_(pa.int64())))
    if has_out:
        table = table.append_column(pa.field("output_tokens", pa.list_(pa.int32()), nullable=True),
                                    pa.array(outputs, pa.list_(pa.int32())))
    if "cache_salt" in table.column_names:
        salts = [None if s is None else hashlib.blake2b(s.encode(), digest_size=16,
                                                          key=key).hexdigest()
                 for s in table["cache_salt"].to_pylist()]
        i = table.column_names.index("cache_salt")
        table = table.set_column(i, pa.field("cache_salt", pa.string(), nullable=True),
                                 pa.array(salts, pa.string()))
    header = dict(trace.header)
    header["prompt_blocks"] = {"block_tokens": unit}
    header["source"] = {**header.get("source", {}), "anonymized": True}
    store_ops = trace.store_ops
    if store_ops is not None:
        i = store_ops.column_names.index("key")
        store_ops = store_ops.set_column(i, pa.field("key", pa.string(), nullable=True),
                                         pa.nulls(store_ops.num_rows, pa.string()))
    kv_events = trace.kv_events
    if kv_events is not None and "hash" in kv_events.column_names:
        i = kv_events.column_names.index("hash")
        kv_events = kv_events.set_column(i, pa.field("hash", pa.string(), nullable=True),
                                         pa.nulls(kv_events.num_rows, pa.string()))
    return Trace(header=header, requests=table, events=trace.events, outcomes=trace.outcomes,
                 steps=trace.steps, store_ops=store_ops, goldens=trace.goldens,
                 store_goldens=trace.store_goldens, kv_events=kv_events,
                 event_goldens=trace.event_goldens)
