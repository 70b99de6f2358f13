"""Benchmark: does peak memory follow the trace length? One hour against N hours.

Writes the Mooncake conversation hour and the same hour repeated ``--hours``
times (``day_trace.py``: shifted arrivals, fresh prefixes), replays each in a
fresh process with its outcomes streamed (``replay(sink=)`` into
:class:`replayer.report.JsonStream`, the ``--json`` bytes written as they
complete), and prints wall seconds, x real time and peak RSS of both and the
ratio of peak RSS; mode ``read`` measures only what still grows with the trace
without vLLM (reading the trace, its row columns, the schedule).

    python benchmarks/replay_day.py                      # the day: 24 hours (hours of CPU)
    python benchmarks/replay_day.py --hours 4 --limit 1000   # a small check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from day_trace import HOUR_MS, write_day  # noqa: E402
from replay_conversation import GEOMETRIES, quiet_child  # noqa: E402


def _child(mode: str, trace_dir: str) -> dict:
    t0 = time.perf_counter()
    quiet_child()
    from traces import read_trace

    trace = read_trace(trace_dir)
    if mode == "replay":
        # As `replayer run --json` would with outcomes streamed: written as they complete.
        from replayer.replay import replay
        from replayer.report import JsonStream
        from replayer.runner import engine_here

        with tempfile.TemporaryFile("w+") as out, engine_here(trace) as adapter:
            stream = JsonStream(out, adapter.info)
            stream.finish(replay(trace, adapter, sink=stream))
            n = out.tell()
    else:                       # what grows with the trace, without vLLM: read, rows, schedule
        from replayer.schedule import Schedule
        from traces.materialize import TokenSource, request_rows

        rows = request_rows(trace.requests)
        TokenSource(trace.header, trace.requests)
        Schedule(rows.arrival_step, rows.after)
        n = 0
    return {"wall_s": time.perf_counter() - t0, "json_chars": n,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _measure(mode: str, trace_dir: Path) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=f"{ROOT}:{ROOT / 'benchmarks'}")
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(trace_dir)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{mode} on {trace_dir} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--limit", type=int, help="first N requests of the hour only")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="full-attention-b16")
    ap.add_argument("--modes", default="read,replay", help="read and/or replay")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    work = Path(tempfile.mkdtemp(prefix="replayer-day-"))
    figures = {}
    for hours in (1, args.hours):
        tdir = write_day(hours, args.limit, args.geometry, work / f"{hours}h")
        for mode in args.modes.split(","):
            r = _measure(mode, tdir)
            figures[(mode, hours)] = r
            real_s = hours * HOUR_MS / 1000 if args.limit is None else None
            speed = f"{real_s / r['wall_s']:7.1f}x" if real_s else "       -"
            print(f"{args.geometry} {hours:>2} h{' (first %d)' % args.limit if args.limit else ''}"
                  f" {mode:<7} wall {r['wall_s']:8.1f} s {speed} real time, peak RSS "
                  f"{r['peak_rss_mb']:7.0f} MB", flush=True)
    for mode in args.modes.split(","):
        one, many = figures[(mode, 1)], figures[(mode, args.hours)]
        print(f"{mode}: peak RSS {args.hours} h / 1 h = "
              f"{many['peak_rss_mb'] / one['peak_rss_mb']:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
