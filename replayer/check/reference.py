"""What a hit is held to: its request recomputed cold, no cache, no store.

The reference side of ``check --recompute`` (:mod:`.recompute` runs it,
:mod:`.divergence` compares): the trace of the hit requests replayed in a
fresh engine, each under a cache salt of its own, and the calibration that
measures how far two honest computations of the same tokens may differ.
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from replayer.check.divergence import max_diff
from replayer.replay.loop import ReplayResult
from traces import Trace
from traces.model.engine_spec import EngineBlock

SALT = "prefix-replayer recompute"
# The connector's settings: a recompute reads no store.
STORE_KEYS = ("connector", "connector_config", "kv_load_failure_policy",
              "mooncake_global_segment_size")


def cold_trace(trace: Trace, ids: list[str], max_num_batched_tokens: int | None = None,
               arrivals: dict[str, int] | None = None) -> Trace:
    """``ids`` replayed cold, each under a cache salt of its own (no cached block, no
    store key can serve it), no connector, no events, the same engine
    (``max_model_len`` and ``num_gpu_blocks`` pinned to the original's, so the model
    and the cache are the same). ``arrivals``: each request enters at the step it
    entered the original replay (batched as it was); without, one after another.
    ``max_num_batched_tokens`` changes only the prefill chunking."""
    sized = trace.sized_engine()
    settings = {k: v for k, v in sized.to_header().items() if k not in STORE_KEYS}
    settings.update(max_model_len=sized.max_model_len, num_gpu_blocks=sized.num_gpu_blocks)
    if max_num_batched_tokens is not None:
        settings["max_num_batched_tokens"] = max_num_batched_tokens
    engine = EngineBlock.from_dict("engine", settings)
    keep = pc.is_in(trace.requests["id"], value_set=pa.array(ids, pa.string()))
    requests = trace.requests.filter(keep)
    order = {rid: i for i, rid in enumerate(ids)}
    requests = requests.take(sorted(range(requests.num_rows),
                                    key=lambda i: order[requests["id"][i].as_py()]))
    n = requests.num_rows
    rids = [requests["id"][i].as_py() for i in range(n)]
    if arrivals is None:
        steps, after = [0] + [None] * (n - 1), [None] + rids[:-1]
    else:
        steps, after = [arrivals[r] for r in rids], [None] * n
    columns = {"arrival_step": pa.array(steps, pa.int64()),
               "after": pa.array(after, pa.string()),
               "cache_salt": pa.array([f"{SALT}:{r}" for r in rids], pa.string())}
    for name, values in columns.items():
        if name in requests.column_names:
            requests = requests.set_column(requests.column_names.index(name), name, values)
        else:
            requests = requests.append_column(name, values)
    for name in ("arrival_ms", "arrival_order"):
        if name in requests.column_names:
            requests = requests.drop_columns([name])
    header = {**trace.header, "engine": engine}
    return Trace(header=header, requests=requests, path=trace.path,
                 request_lists=None)


def calibrate(trace: Trace, ids: list[str], replay: Callable[[Trace], ReplayResult],
              arrivals: dict[str, int] | None = None
              ) -> tuple[ReplayResult, float, tuple[int, int]]:
    """The cold recompute of ``ids`` at the trace's chunking and at half of it, and
    the largest logprob difference between the two (the tolerance)."""
    chunk = trace.sized_engine().max_num_batched_tokens or 2048
    block = max(g.block_size for g in trace.engine.kv_groups)
    other = max(block, (chunk // 2) // block * block)
    if other == chunk:
        other = chunk + block
    cold = replay(cold_trace(trace, ids, chunk, arrivals))
    rechunked = replay(cold_trace(trace, ids, other, arrivals))
    a, b = cold.by_id(), rechunked.by_id()
    tolerance = 0.0
    for rid in ids:
        if a[rid].logprobs and b[rid].logprobs:
            tolerance = max(tolerance, max_diff(a[rid].logprobs, b[rid].logprobs)[0])
    return cold, tolerance, (chunk, other)
