"""Benchmark: the replay's cost per extra store worker rank.

The first 1,000 conversation requests through the MooncakeStore connector
(the geometry and GPU cache of ``replay_store.py``, the in-memory store) at
``tensor_parallel_size`` 1, 2 and 4, one real ``MooncakeStoreWorker`` per rank in
one process (TP 4 replays the 8-head twin of the tiny model, so its KV heads
split over the ranks and each rank writes its own attention keys). Each rank
mounts the same segment, as Mooncake's clients do. Each runs in a
fresh process; prints wall, vLLM and store seconds, store ops, peak RSS, the
wall cost of each rank beyond the first, and whether the hits are the same at
every size (they should be: the ranks split keys, not tokens).

    python benchmarks/store_ranks.py [--limit 1000] [--sizes 1,2,4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import public_trace  # noqa: E402  (benchmarks/, first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_store import ENGINE, POOL_BYTES, quiet_store_child  # noqa: E402  (same geometry)


def _child(tp: str, trace_dir: str) -> dict:
    t0 = time.perf_counter()
    quiet_store_child()
    from replayer.replay.execution.clients import replay_on
    from replayer.replay.store import StoreSpec
    from traces import read_trace

    # Each rank mounts the same segment, as Mooncake's clients do: the pool grows
    # with the ranks, as the keys do (the null model's ranks hold whole pages, so a
    # rank's shard is as large as one rank's whole KV, not 1/TP of it).
    result = replay_on(read_trace(trace_dir),
                       store=StoreSpec("memory", capacity_bytes=POOL_BYTES))
    rows = result.store["rows"]
    wall = time.perf_counter() - t0
    ops = sum(1 for r in rows if r["op"] in ("put", "get", "exists", "lookup"))
    hits = [(r.id, r.num_cached_tokens) for r in result.requests]
    return {"tp": int(tp), "wall_s": wall, "vllm_s": result.timings["vllm_s"],
            "store_s": result.store["seconds"], "ops": ops,
            "ranks": len({r["rank"] for r in rows}),
            "hit_rate": result.summary()["hit_rate"],
            "hits": hashlib.sha256(json.dumps(hits).encode()).hexdigest(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--sizes", default="1,2,4", help="tensor_parallel_size values")
    args, source = public_trace.parse_or_run_child(ap, _child)
    sys.path.insert(0, str(ROOT))
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    work = Path(tempfile.mkdtemp(prefix="replayer-ranks-bench-"))
    print(f"{'tp':>3} {'ranks':>5} {'wall s':>7} {'vllm s':>7} {'store s':>8} {'store ops':>9} "
          f"{'hit':>6} {'rss MB':>7} {'+s per extra rank':>18}")
    base = None
    hits = set()
    for tp in (int(x) for x in args.sizes.split(",")):
        engine = {**ENGINE, "tensor_parallel_size": tp}
        trace_dir = write_trace(import_mooncake(source, limit=args.limit, engine=engine),
                                work / f"tp{tp}")
        r = public_trace.run_child(__file__, str(tp), trace_dir)
        base = r["wall_s"] if base is None else base
        extra = "" if tp == 1 else f"{(r['wall_s'] - base) / (tp - 1):>18.1f}"
        hits.add(r["hits"])
        print(f"{tp:>3} {r['ranks']:>5} {r['wall_s']:>7.1f} {r['vllm_s']:>7.1f} "
              f"{r['store_s']:>8.2f} {r['ops']:>9} {r['hit_rate']:>6.1%} "
              f"{r['peak_rss_mb']:>7.0f} {extra:>18}", flush=True)
    print(f"same hits at every size: {len(hits) == 1}")


if __name__ == "__main__":
    main()
