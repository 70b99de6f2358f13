"""How much could a fast-forward skip? Counts the replay's quiet steps.

A step is *quiet* when nothing in it can change an outcome or the block pool
in a way a later step could notice: no request arrives before it, none waits,
every running request only decodes, none finishes, vLLM takes no new block
from the free queue, the cached-hash map and the free queue keep their sizes,
and no request gains a block hash. A
run of quiet steps is what an exact fast-forward could advance in one move
without re-implementing vLLM's allocation. This prints, per geometry, the
steps, the quiet steps, and the steps an ideal fast-forward would save (each
run of k quiet steps costing one), on the first ``--limit`` requests.

    python benchmarks/quiet_steps.py --limit 1000
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from replay_conversation import GEOMETRIES, SOURCE  # noqa: E402


def count(geometry: str, limit: int) -> dict:
    from replayer.replay.loop import replay
    from replayer.replay.execution.in_process import engine_here
    from traces.importers.mooncake import import_mooncake

    trace = import_mooncake(SOURCE, limit=limit, engine=GEOMETRIES[geometry])
    with engine_here(trace) as adapter:
        sched = adapter.scheduler
        pool = sched.kv_cache_manager.block_pool
        noisy = {"flag": False}
        get_new_blocks = pool.get_new_blocks

        def new_blocks(num_blocks, *args, **kwargs):
            noisy["flag"] = noisy["flag"] or num_blocks > 0
            return get_new_blocks(num_blocks, *args, **kwargs)

        pool.get_new_blocks = new_blocks

        def pool_mark():
            return (len(pool.cached_block_hash_to_block._cache),
                    pool.free_block_queue.num_free_blocks)

        add, step = adapter.add_request, adapter.step
        quiet_flags: list[bool] = []

        def add_request(request):
            noisy["flag"] = True
            return add(request)

        def stepped():
            reqs = list(sched.requests.values())
            before = (len(sched.waiting) > 0
                      or any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs))
            hashes = sum(len(r.block_hashes) for r in reqs)
            mark = pool_mark()
            res = step()
            after = sum(len(r.block_hashes) for r in sched.requests.values())
            quiet = not (noisy["flag"] or before or res.finished or res.prefills
                         or after != hashes or pool_mark() != mark)
            quiet_flags.append(quiet)
            noisy["flag"] = False
            return res

        adapter.add_request, adapter.step = add_request, stepped
        replay(trace, adapter)
    runs, k = [], 0
    for q in quiet_flags + [False]:
        if q:
            k += 1
        elif k:
            runs.append(k)
            k = 0
    return {"steps": len(quiet_flags), "quiet": sum(runs), "runs": len(runs),
            "saved": sum(r - 1 for r in runs), "longest": max(runs, default=0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in args.geometry or list(GEOMETRIES):
        c = count(name, args.limit)
        print(f"{name:<27} {args.limit} requests: {c['steps']} steps, {c['quiet']} quiet "
              f"({c['quiet'] / c['steps']:.1%}) in {c['runs']} runs (longest {c['longest']}); "
              f"an ideal fast-forward saves {c['saved']} steps ({c['saved'] / c['steps']:.1%})",
              flush=True)


if __name__ == "__main__":
    main()
