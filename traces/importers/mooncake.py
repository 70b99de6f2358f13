"""Import the Mooncake FAST'25 trace format (JSON lines of hash-id blocks).

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; hash ids name 512-token prefix blocks (equal id at the
same position = identical block). No tokens are stored: the trace keeps the
block ids and the replayer synthesises each block's tokens from its id alone
(:func:`traces.model.tokens.block_tokens`), so the prefix structure is kept exactly.
Request ids are 0-based line numbers of the source file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces.model import schema
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError
from traces.model.limits import (
    MAX_IMPORT_BLOCK_IDS,
    MAX_INT,
    MAX_TOKENS,
    jsonl_lines,
    load_json,
    short,
)
from traces.model.step_clock import DEFAULT_STEP_MS, arrival_steps
from traces.trace import Trace, validate_trace

MOONCAKE_BLOCK_TOKENS = 512

# The documented default engine for imported traces: full attention at block 16,
# an 8192-token step budget, 256 sequences, 2 M tokens of KV.
DEFAULT_ENGINE = EngineBlock.from_dict("the importer's default engine", {
    "block_size": 16,
    "kv_groups": [{"kind": "full_attention"}],
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "num_gpu_blocks": 131072,
})

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _bad(path: Path, line: int, msg: str) -> TraceError:
    return TraceError(path, msg, row=line)


def import_mooncake(path: str | Path, *, limit: int | None = None,
                    engine: EngineBlock | dict[str, Any] | None = None,
                    step_ms: int = DEFAULT_STEP_MS) -> Trace:
    path = Path(path)
    ids: list[str] = []
    ts: list[int] = []
    n_in: list[int] = []
    n_out: list[int] = []
    blocks: list[list[int]] = []
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise TraceError(path, f"cannot read ({exc.strerror})") from None
    with fh:
        held = 0                                  # block ids so far (memory bound)
        for lineno, raw in jsonl_lines(path, fh):  # streamed, each line bounded
            if limit is not None and len(ids) >= limit:
                break
            try:
                line = raw.decode()
            except UnicodeDecodeError as exc:
                raise _bad(path, lineno, f"not UTF-8 text ({exc.reason})") from None
            if not line.strip():
                raise _bad(path, lineno, "empty line")
            rec = load_json(path, line, row=lineno)
            if not isinstance(rec, dict):
                raise _bad(path, lineno, "a line must be a JSON object")
            for f in _FIELDS:
                if f not in rec:
                    raise TraceError(path, "missing field", column=f, row=lineno)
            for f in _FIELDS[:3]:
                v = rec[f]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise TraceError(path, f"must be a non-negative integer, got {short(v)}",
                                     column=f, row=lineno)
                if v > (MAX_INT if f == "timestamp" else MAX_TOKENS):
                    raise TraceError(path, f"{short(v)} is above the limit of "
                                     f"{MAX_INT if f == 'timestamp' else MAX_TOKENS}",
                                     column=f, row=lineno)
            h = rec["hash_ids"]
            if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                   and -2**63 <= x < 2**63 for x in h):
                raise TraceError(path, "must be a list of 64-bit integers", column="hash_ids",
                                 row=lineno)
            held += len(h)
            if len(h) > MAX_TOKENS // MOONCAKE_BLOCK_TOKENS + 1 or held > MAX_IMPORT_BLOCK_IDS:
                raise TraceError(path, f"too many block ids ({len(h)} on this line, {held} so "
                                 f"far; at most {MAX_IMPORT_BLOCK_IDS} in all: use --limit)",
                                 column="hash_ids", row=lineno)
            if rec["input_length"] < 1:
                raise TraceError(path, "a prompt needs at least one token",
                                 column="input_length", row=lineno)
            if len(h) * MOONCAKE_BLOCK_TOKENS < rec["input_length"]:
                raise TraceError(path, f"{len(h)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens cannot "
                                 f"hold input_length {rec['input_length']}",
                                 column="hash_ids", row=lineno)
            if ts and rec["timestamp"] < ts[-1]:
                raise TraceError(path, "timestamps must not go backwards",
                                 column="timestamp", row=lineno)
            ids.append(str(lineno))
            ts.append(rec["timestamp"])
            n_in.append(rec["input_length"])
            # A zero-length output still costs the prefill step that samples one token.
            n_out.append(max(1, rec["output_length"]))
            blocks.append(h)
    if not ids:
        raise TraceError(path, "no requests")
    ms = np.asarray(ts, dtype=np.int64)
    requests = pa.table({
        "id": pa.array(ids, pa.string()),
        "arrival_step": pa.array(arrival_steps(ms, step_ms), pa.int64()),
        "arrival_ms": pa.array(ms, pa.int64()),
        "num_prompt_tokens": pa.array(n_in, pa.int64()),
        "prompt_block_ids": pa.array(blocks, pa.list_(pa.int64())),
        "output_len": pa.array(n_out, pa.int64()),
    })
    requests = requests.cast(schema.REQUESTS.arrow_schema(set(requests.column_names)))
    header = {
        "schema_version": schema.SCHEMA_VERSION,
        "engine": DEFAULT_ENGINE if engine is None else engine,     # Trace validates it
        "source": {"kind": "imported", "format": "mooncake", "from": path.name,
                   "requests": len(ids)},
        "prompt_blocks": {"block_tokens": MOONCAKE_BLOCK_TOKENS},
        "step_clock": {"step_ms": step_ms},
    }
    trace = Trace(header=header, requests=requests)
    validate_trace(path, trace)
    return trace
