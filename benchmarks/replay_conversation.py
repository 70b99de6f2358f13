"""Benchmark: replay the Mooncake conversation trace step by step and fast.

For each geometry (full attention at block 16; the hybrid #51295 geometry) and
each slice (first 1,000 requests; the whole 12,031), it runs

* ``step-by-step``: the replayer as ``replayer run --no-shortcuts`` does (every
  request on vLLM's plain path), start-up included;
* ``fast``: the replayer as ``replayer run`` does (with its shortcuts);
* with ``--bare``, also a bare loop: the same vLLM build, then nothing but
  ``Request`` creation, ``schedule``, a fixed model output and
  ``update_from_output`` (the floor for the harness's own overhead),

and prints wall seconds, speed-up over the trace's real time, CPU seconds,
start-up seconds (imports and building the engine), steps, seconds
inside vLLM's ``schedule``/``update_from_output``, the harness's own seconds and
its ratio to vLLM's, peak RSS and the hit rate; then the fast / step-by-step
wall ratio and whether both wrote the same ``--json`` bytes ("identical: yes").
Each measurement runs in a fresh process so start-up and peak RSS are honest.

    python benchmarks/replay_conversation.py            # everything, once (~15 min)
    python benchmarks/replay_conversation.py --quick    # first 1,000 requests, 3 runs each

Single runs on a 2-core machine vary by up to 40%, so each measurement runs
``--repeat N`` times (interleaved across modes, each with its own
PYTHONHASHSEED) and the median run is printed with the min-max of its wall
times; "identical" means every ``--json`` of every run and mode hashed alike.

``MOONCAKE_TRACE`` names the source JSONL if it is not in ``../shared/traces``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import public_trace  # noqa: E402  (benchmarks/, first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
# Default source for the day and quiet-step scripts (the CLI here takes --trace).
SOURCE = Path(os.environ.get(public_trace.ENV) or public_trace.BESIDE_CHECKOUT)

KV_TOKENS = 2 * 1024 * 1024
GEOMETRIES = {
    "full-attention-b16": {
        "block_size": 16, "kv_groups": [{"kind": "full_attention"}],
        "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "num_gpu_blocks": KV_TOKENS // 16,
    },
    "hybrid-b1536-pmu128-eagle": {
        "block_size": 1536, "prefix_match_unit": 128,
        "kv_groups": [{"kind": "full_attention"}, {"kind": "mamba"}],
        "speculative": {"method": "eagle", "num_speculative_tokens": 1,
                        "disable_lookahead_block_hashes": True},
        "prefix_cache_retention_interval": 0,
        "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "num_gpu_blocks": KV_TOKENS // 1536,
    },
}


# Replayer modes: name -> shortcuts on.
MODES = {"step-by-step": False, "fast": True}


def quiet_child() -> None:
    """A measuring child: vLLM and torch quiet, no hub, this checkout importable."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))


def _child(mode: str, trace_dir: str) -> dict:
    """Run one measurement in this (fresh) process and return its figures."""
    t0 = time.perf_counter()
    quiet_child()
    from traces import read_trace
    from replayer.replay.execution.clients import replay_on

    trace = read_trace(trace_dir)
    digest = None
    if mode in MODES:
        from replayer.check.output import dumps

        result = replay_on(trace, shortcuts=MODES[mode])
        digest = hashlib.sha256(dumps(result).encode()).hexdigest()
        s = result.summary()
        vllm_s = result.timings["vllm_s"]
        steps = s["steps"]
        hit_rate = s["hit_rate"]
        startup = result.timings["startup_s"]
    else:
        from bare_loop import bare_loop

        steps, hit_rate, vllm_s, startup = bare_loop(trace)
    wall = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    rss = use.ru_maxrss / 1024
    return {"wall_s": wall, "cpu_s": use.ru_utime + use.ru_stime, "vllm_s": vllm_s, "steps": steps, "hit_rate": hit_rate,
            "peak_rss_mb": rss, "startup_s": startup, "json_sha256": digest}


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (its own figures, not a mix of runs), with
    the spread of wall times across runs."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["wall_min_s"], mid["wall_max_s"] = ordered[0]["wall_s"], ordered[-1]["wall_s"]
    return mid


def measure_modes(modes: list[str], trace_dir: Path, repeat: int) -> tuple[dict, set]:
    """Each mode ``repeat`` times, interleaved (step, fast, step, fast, ...) so
    that a slow spell of the machine hits both alike; each run in a fresh process
    with its own PYTHONHASHSEED. Returns the median run per mode and every
    ``--json`` digest seen (one digest: identical across modes, runs and seeds)."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(repeat):
        for mode in modes:
            runs[mode].append(public_trace.run_child(__file__, mode, trace_dir,
                                                     hash_seed=k * 7919 + 1))
    digests = {r["json_sha256"] for m in modes if m in MODES for r in runs[m]}
    return {m: median_run(rs) for m, rs in runs.items()}, digests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="first 1,000 requests only")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append")
    ap.add_argument("--bare", action="store_true", help="also run the bare scheduler loop")
    ap.add_argument("--repeat", type=int, metavar="N",
                    help="runs of each measurement; the median run is printed "
                         "(default 3 with --quick, else 1)")
    args, source = public_trace.parse_or_run_child(ap, _child)
    repeat = args.repeat or (3 if args.quick else 1)
    if repeat < 1:
        ap.error("--repeat must be at least 1")
    sys.path.insert(0, str(ROOT))
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    slices = [1000] if args.quick else [1000, None]
    work = Path(tempfile.mkdtemp(prefix="replayer-bench-"))
    print(f"median of {repeat} run{'s' * (repeat > 1)} each, each in a fresh process "
          f"(PYTHONHASHSEED differs per run)", flush=True)
    print(f"{'geometry':<27} {'requests':>8} {'mode':<12} {'wall s':>7} {'min-max':>11} "
          f"{'x real':>7} {'cpu s':>7} {'start s':>7} {'steps':>7} {'vllm s':>7} "
          f"{'harness s':>9} {'ratio':>6} {'rss MB':>7} {'hit':>6}")
    for name in args.geometry or list(GEOMETRIES):
        for limit in slices:
            trace = import_mooncake(source, limit=limit, engine=GEOMETRIES[name])
            tdir = write_trace(trace, work / f"{name}-{limit or 'all'}")
            ms = trace.requests["arrival_ms"].to_pylist()
            real_s = (ms[-1] - ms[0]) / 1000 or 1.0
            rows, digests = measure_modes((["bare"] if args.bare else []) + list(MODES),
                                          tdir, repeat)
            for mode, r in rows.items():
                harness = r["wall_s"] - r["vllm_s"]
                spread = f"{r['wall_min_s']:.1f}-{r['wall_max_s']:.1f}"
                print(f"{name:<27} {trace.requests.num_rows:>8} {mode:<12} {r['wall_s']:>7.1f} "
                      f"{spread:>11} {real_s / r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} "
                      f"{r['startup_s']:>7.1f} {r['steps']:>7} {r['vllm_s']:>7.1f} "
                      f"{harness:>9.1f} {harness / r['vllm_s']:>6.2f} {r['peak_rss_mb']:>7.0f} "
                      f"{r['hit_rate']:>6.1%}", flush=True)
            slow, fast = rows["step-by-step"], rows["fast"]
            same = len(digests) == 1
            print(f"{'':<27} step-by-step {slow['wall_s']:.1f} s, fast {fast['wall_s']:.1f} s, "
                  f"fast / step-by-step = {fast['wall_s'] / slow['wall_s']:.3f} "
                  f"(CPU {fast['cpu_s'] / slow['cpu_s']:.3f}), "
                  f"{real_s / fast['wall_s']:.1f}x real time, peak RSS "
                  f"{fast['peak_rss_mb']:.0f} MB; identical: {'yes' if same else 'NO'} "
                  f"({2 * repeat} --json outputs)", flush=True)
            if "bare" in rows:
                print(f"{'':<27} fast / bare wall = {fast['wall_s'] / rows['bare']['wall_s']:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
