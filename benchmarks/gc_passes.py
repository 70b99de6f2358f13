"""What Python's garbage collector costs a replay, with and without the replayer's tuning.

For each geometry of ``replay_conversation.py`` it replays the first
``--limit`` conversation requests twice, each in a fresh process: under
Python's own thresholds (``replayer.replay.gc_tuning`` made a no-op) and as the
replayer runs (thresholds raised while vLLM is imported and built and while
the loop runs). It prints, for start-up (import and engine build) and for
the loop apart, the collector's passes, the seconds spent inside them (wall,
from ``gc.callbacks``) and the process's CPU seconds, then whether both wrote
the same ``--json`` bytes. On a shared machine the seconds vary from run to
run; the pass counts do not.

    python benchmarks/gc_passes.py --limit 1000
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import public_trace  # noqa: E402
from replay_conversation import GEOMETRIES, quiet_child  # noqa: E402

MODES = ("python", "replayer")


class Passes:
    """Counts the collector's passes and seconds through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._t = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t

    def take(self) -> tuple[int, float]:
        out = (self.count, self.seconds)
        self.count, self.seconds = 0, 0.0
        return out


def _child(mode: str, trace_dir: str) -> dict:
    passes = Passes()          # before vLLM's import, which engine_here does
    quiet_child()
    from replayer.replay import gc_tuning

    if mode == "python":       # the tuning keeps thresholds it would not raise
        python = gc.get_threshold()
        gc_tuning.REPLAY_GEN0_THRESHOLD, gc_tuning.REPLAY_GEN2_THRESHOLD = python[0], python[2]
    from replayer.replay.loop import replay
    from replayer.check.output import dumps
    from replayer.replay.execution.in_process import engine_here
    from traces import read_trace

    trace = read_trace(trace_dir)
    passes.take()
    c0 = time.process_time()
    with engine_here(trace) as adapter:
        c1 = time.process_time()
        start = passes.take()
        result = replay(trace, adapter)
        c2 = time.process_time()
        loop = passes.take()
    return {"start_passes": start[0], "start_gc_s": start[1], "start_cpu_s": c1 - c0,
            "loop_passes": loop[0], "loop_gc_s": loop[1], "loop_cpu_s": c2 - c1,
            "json_sha256": hashlib.sha256(dumps(result).encode()).hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1000, help="first N requests (default 1000)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append")
    args, source = public_trace.parse_or_run_child(ap, _child)
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    work = Path(tempfile.mkdtemp(prefix="replayer-gc-"))
    print(f"{'geometry':<27} {'gc':<9} {'start passes':>12} {'gc s':>6} {'cpu s':>6} "
          f"{'loop passes':>11} {'gc s':>6} {'cpu s':>6}")
    for name in args.geometry or list(GEOMETRIES):
        trace = import_mooncake(source, limit=args.limit, engine=GEOMETRIES[name])
        tdir = write_trace(trace, work / name)
        digests = set()
        for mode in MODES:
            r = public_trace.run_child(__file__, mode, tdir)
            digests.add(r["json_sha256"])
            print(f"{name:<27} {mode:<9} {r['start_passes']:>12} {r['start_gc_s']:>6.2f} "
                  f"{r['start_cpu_s']:>6.1f} {r['loop_passes']:>11} {r['loop_gc_s']:>6.2f} "
                  f"{r['loop_cpu_s']:>6.1f}", flush=True)
        print(f"{'':<27} identical: {'yes' if len(digests) == 1 else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
