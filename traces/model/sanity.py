"""Checks across fields that a schema cannot express, run when a trace is loaded.

Each one refuses, with one line naming the file (and column and row), an
input the replay would otherwise accept silently and get wrong, or fail on
only after a long engine start-up: an ``after:`` cycle, a prompt longer than
``max_model_len``, async scheduling in a trace that did not record it, sizes
past :mod:`traces.model.limits`, a golden table with repeated ids or filed under
another engine's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError
from traces.model.limits import MAX_BLOCK_TOKENS, MAX_GPU_BLOCKS, MAX_TOKENS, check_int


def _first_true(mask) -> int | None:
    idx = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if idx < 0 else idx


def check_header_bounds(path: Path, header: dict[str, Any]) -> None:
    blocks = header.get("prompt_blocks")
    if isinstance(blocks, dict) and "block_tokens" in blocks:
        check_int(path, "header.prompt_blocks.block_tokens", blocks["block_tokens"], 1,
                  MAX_BLOCK_TOKENS)


def check_async_scheduling(path: Any, engine: EngineBlock, source_kind: str | None) -> None:
    """The replay steps synchronously: async scheduling is accepted only in a recording
    (replayed with the same hits, not step for step: see docs/recording.md), never asked for."""
    if engine.async_scheduling and source_kind != "recorded":
        raise TraceError(path, "engine.async_scheduling: true is not replayed (the replay "
                               "schedules synchronously); remove it or set it to false")


def request_bound_checks(path: Path, engine: EngineBlock,
                         names: set[str]) -> list[tuple[bool, Callable[[pa.Table], None]]]:
    """Lengths within MAX_TOKENS and ``max_model_len``, refused as vLLM's front
    end does, as ordered checks, each ``(reads a list column, check)``, so that
    a streamed read runs the list ones batch by batch
    (:func:`traces.model.validate.validate_request_batches`)."""
    checks: list[tuple[bool, Callable[[pa.Table], None]]] = []

    def too_long(name: str) -> Callable[[pa.Table], None]:
        def check(t: pa.Table) -> None:
            row = _first_true(pc.greater(t[name], MAX_TOKENS))
            if row is not None:
                raise TraceError(path, f"{t[name][row].as_py()} is above the limit of "
                                       f"{MAX_TOKENS} tokens", column=name, row=row)
        return check

    for name in ("num_prompt_tokens", "output_len"):
        if name in names:
            checks.append((False, too_long(name)))
    max_len = engine.max_model_len
    if max_len is not None and "num_prompt_tokens" in names:
        def model_len(t: pa.Table) -> None:
            row = _first_true(pc.greater(t["num_prompt_tokens"], max_len))
            if row is not None:
                n = t["num_prompt_tokens"][row].as_py()
                raise TraceError(path, f"the prompt (length {n}) is longer than the maximum "
                                       f"model length of {max_len} (vLLM refuses such a request)",
                                 column="num_prompt_tokens", row=row)
        checks.append((False, model_len))
    if "prompt_block_ids" in names:
        def many_blocks(t: pa.Table) -> None:
            row = _first_true(pc.greater(pc.list_value_length(t["prompt_block_ids"]), MAX_TOKENS))
            if row is not None:
                raise TraceError(path, f"more than {MAX_TOKENS} block ids",
                                 column="prompt_block_ids", row=row)
        checks.append((True, many_blocks))
    if "after" in names and "id" in names:
        checks.append((False, lambda t: check_after_cycles(path, t["id"].to_pylist(),
                                                           t["after"].to_pylist())))
    return checks


def check_after_cycles(path: Path, ids: list[Any], afters: list[Any]) -> None:
    """``after:`` chains must end in a request that arrives on its own."""
    parent = {rid: a for rid, a in zip(ids, afters) if a is not None}
    row_of = {rid: i for i, rid in enumerate(ids)}
    state: dict[Any, int] = {}           # 1: on the current chain, 2: reaches a root
    for start in ids:
        chain = []
        rid = start
        while rid in parent and state.get(rid) is None:
            state[rid] = 1
            chain.append(rid)
            rid = parent[rid]
        if state.get(rid) == 1:          # came back onto this chain
            cycle = chain[chain.index(rid):]
            shown = " -> ".join(repr(r) for r in (cycle + [rid])[:8])
            raise TraceError(path, f"'after' cycle: {shown}{' ...' if len(cycle) > 7 else ''} "
                                   "(no request in it can ever arrive)",
                             column="after", row=row_of.get(rid))
        for r in chain:
            state[r] = 2


def check_golden_table(path: Path, table: pa.Table, key: str, expected_file: str) -> None:
    """One row per request, filed under the engine its metadata names."""
    if path.name != expected_file:
        raise TraceError(path, f"its metadata names engine {key!r}, whose goldens belong in "
                               f"{expected_file}; a golden filed under another engine's name "
                               "would be checked against the wrong engine")
    if "kind" in table.column_names:      # store golden: one row per put and per lookup
        rows = zip(table["kind"].to_pylist(), table["request"].to_pylist(),
                   table["group"].to_pylist(), table["boundary"].to_pylist())
        column, what = "request", "duplicate store golden row"
    else:
        rows = ((rid,) for rid in table["id"].to_pylist())
        column, what = "id", "duplicate request id"
    seen: set[Any] = set()
    for row, item in enumerate(rows):
        if item in seen:
            shown = item[0] if len(item) == 1 else item
            raise TraceError(path, f"{what} {shown!r}", column=column, row=row)
        seen.add(item)


def check_sized_engine(path: Path, trace: Any) -> None:
    """The KV blocks the replay would build (given, or sized for the longest request)
    stay within MAX_GPU_BLOCKS: refused now, not after vLLM has allocated them."""
    if trace.requests.num_rows == 0:
        return
    blocks = trace.sized_engine().num_gpu_blocks
    if blocks is not None and blocks > MAX_GPU_BLOCKS:
        raise TraceError(path, f"engine.num_gpu_blocks omitted: sized for the longest request it "
                               f"would be {blocks}, above the limit of {MAX_GPU_BLOCKS}; set "
                               "engine.num_gpu_blocks (or a larger block_size)")
