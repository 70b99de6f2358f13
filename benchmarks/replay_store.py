"""Benchmark: the first 1,000 conversation requests through the MooncakeStore connector.

Runs the hybrid #51295 geometry with ``connector: mooncake_store`` and a GPU
cache small enough that resends fall back to the store, once on the in-memory
store and once on a real ``mooncake_master`` the replayer starts on loopback,
each in a fresh process, and prints wall seconds, puts and gets per second,
bytes moved, store seconds against vLLM seconds, and whether both backends
agree.

    python benchmarks/replay_store.py [--limit 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import public_trace  # noqa: E402  (benchmarks/, first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_conversation import GEOMETRIES  # noqa: E402  (the same hybrid geometry)

# 512 blocks of 1536 tokens: ~0.8 M tokens of GPU KV, so history is evicted
# from the GPU and returning conversations must come back from the store.
ENGINE = {**GEOMETRIES["hybrid-b1536-pmu128-eagle"], "num_gpu_blocks": 512,
          "connector": "mooncake_store"}

POOL_BYTES = 3 * 1024 ** 3


def quiet_store_child() -> None:
    """A measuring child of a store benchmark: vLLM and the Mooncake client quiet
    (their logs would be timed too), no model hub, this checkout importable."""
    for k, v in {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_LOGS": "-torch", "HF_HUB_OFFLINE": "1",
                 "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "3"}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))


def _child(backend: str, trace_dir: str) -> dict:
    t0 = time.perf_counter()
    quiet_store_child()
    from replayer.replay.execution.clients import replay_on
    from replayer.replay.store import StoreSpec
    from traces import read_trace

    # A pool larger than everything written: neither backend evicts, so both
    # must agree exactly (Mooncake's eviction order is its own).
    result = replay_on(read_trace(trace_dir), store=StoreSpec(backend, capacity_bytes=POOL_BYTES))
    rows = result.store["rows"]
    wall = time.perf_counter() - t0
    puts = [r for r in rows if r["op"] == "put" and r["result"] >= 0]
    gets = [r for r in rows if r["op"] == "get" and r["result"] >= 0]
    d = result.as_dict()
    d["store"].pop("backend")
    return {"wall_s": wall, "vllm_s": result.timings["vllm_s"],
            "store_s": result.store["seconds"], "puts": len(puts), "gets": len(gets),
            "lookups": sum(1 for r in rows if r["op"] == "lookup"),
            "bytes": sum(r["bytes"] for r in puts + gets),
            "hit_rate": result.summary()["hit_rate"],
            "external": sum(r.num_external_cached_tokens or 0 for r in result.requests),
            "digest": hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000)
    args, source = public_trace.parse_or_run_child(ap, _child)
    sys.path.insert(0, str(ROOT))
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    work = Path(tempfile.mkdtemp(prefix="replayer-store-bench-"))
    trace_dir = write_trace(import_mooncake(source, limit=args.limit, engine=ENGINE),
                            work / "conv")
    print(f"{'backend':<9} {'wall s':>7} {'vllm s':>7} {'store s':>8} {'store/vllm':>10} "
          f"{'puts':>6} {'puts/s':>7} {'gets':>6} {'gets/s':>7} {'MB moved':>9} {'hit':>6} "
          f"{'from store':>10} {'rss MB':>7}")
    digests = {}
    for backend in ("memory", "mooncake"):
        r = public_trace.run_child(__file__, backend, trace_dir)
        digests[backend] = r["digest"]
        print(f"{backend:<9} {r['wall_s']:>7.1f} {r['vllm_s']:>7.1f} {r['store_s']:>8.2f} "
              f"{r['store_s'] / r['vllm_s']:>10.2f} {r['puts']:>6} "
              f"{r['puts'] / r['wall_s']:>7.0f} {r['gets']:>6} {r['gets'] / r['wall_s']:>7.0f} "
              f"{r['bytes'] / 2**20:>9.1f} {r['hit_rate']:>6.1%} {r['external']:>10} "
              f"{r['peak_rss_mb']:>7.0f}", flush=True)
    print(f"backends agree (outcomes and keys): {digests['memory'] == digests['mooncake']}")


if __name__ == "__main__":
    main()
