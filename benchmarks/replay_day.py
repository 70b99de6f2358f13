"""Benchmark: does peak memory follow the trace length? One hour against N hours.

Writes the Mooncake conversation hour and the same hour repeated ``--hours``
times (``day_trace.py``: shifted arrivals, fresh prefixes; kept in ``--work``
and reused by later runs), replays each in a fresh process as ``replayer run
TRACE --json FILE`` does on the installed vLLM (the trace read with
``stream=True``: prompts batch by batch; outcomes streamed through
``replay(sink=)`` into :class:`replayer.check.output.JsonStream`), and prints wall
seconds, x real time and peak RSS of both and the ratio of peak RSS.

Mode ``read`` does the same without vLLM: what a replay reads and builds
before and while it steps (the streamed read and its validation, the row
columns, the token source, the schedule, then every row's tokens in arrival
order, released as the replay releases them), with each stage's peak above
the memory held before it (``/proc/self/clear_refs`` resets the peak), and the
same figures for a whole read (``stream=False``, what ``check`` and the other
commands do).

    python benchmarks/replay_day.py                              # the day: 24 hours (hours of CPU)
    python benchmarks/replay_day.py --hours 24 --modes read      # seconds
    python benchmarks/replay_day.py --hours 2 --limit 1000       # a small check
    python benchmarks/replay_day.py --trace DIR --modes read     # one existing trace
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from day_trace import HOUR_MS, write_day  # noqa: E402
from public_trace import run_child  # noqa: E402
from replay_conversation import GEOMETRIES, quiet_child  # noqa: E402


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+)", fh.read()).group(1)) / 1024


def _stages(trace_dir: str, stream: bool) -> dict:
    """Each stage's peak RSS above what was held before it, in MB (Linux)."""
    import numpy as np

    from replayer.replay.loop import refuse_unsupported
    from replayer.replay.schedule import Schedule
    from traces import read_trace
    from traces.materialize import TokenSource, request_rows

    figures: dict[str, float] = {}
    base = _status_mb("VmRSS")
    peak = [_status_mb("VmHWM")]           # the process's peak, across the resets

    def stage(name, fn):
        with open("/proc/self/clear_refs", "w") as fh:      # peak RSS := RSS now
            fh.write("5")
        before = _status_mb("VmRSS")
        out = fn()
        top = _status_mb("VmHWM")
        peak.append(top)
        figures[name] = round(top - before, 1)
        return out

    trace = stage("read_trace", lambda: read_trace(trace_dir, stream=stream))
    stage("sized_engine", lambda: (trace.sized_engine(), refuse_unsupported(trace)))
    rows = stage("request_rows", lambda: request_rows(trace.requests))
    tokens = stage("TokenSource", lambda: TokenSource(trace.header, trace.requests,
                                                      trace.request_lists))
    schedule = stage("Schedule", lambda: Schedule(rows.arrival_step, rows.after))

    def every_row():        # the rows in arrival order, as the replay adds them
        arrived = np.zeros(len(rows.ids), dtype=bool)
        clock = 0
        while (nxt := schedule.next_point()) is not None:
            clock = max(clock, nxt)
            for i in schedule.arrivals_due(clock):
                tokens.prompt(i)
                tokens.prompt_blocks(i)
                tokens.output(i, rows.output_len[i], 1)
                tokens.release(i)
                arrived[i] = True
        tokens.close()
        return arrived

    stage("every row's tokens", every_row)
    figures["held after"] = round(_status_mb("VmRSS") - base, 1)
    figures["peak"] = max(peak)
    return figures


def _child(mode: str, trace_dir: str) -> dict:
    t0 = time.perf_counter()
    quiet_child()
    stages = {}
    n = 0
    if mode == "replay":
        # As `replayer run --json FILE` on the installed vLLM: prompts read in
        # batches, outcomes written as they complete.
        from replayer.replay.loop import replay
        from replayer.check.output import JsonStream
        from replayer.replay.execution.in_process import engine_here
        from traces import read_trace

        trace = read_trace(trace_dir, stream=True)
        curve: list[float] = []         # RSS at each tenth of the requests done: flat or growing?

        def progress(p):
            if p.done * 10 >= (len(curve) + 1) * p.total:
                curve.append(round(_status_mb("VmRSS")))

        with tempfile.TemporaryFile("w+") as out, engine_here(trace) as adapter:
            stream = JsonStream(out, adapter.info)
            stream.finish(replay(trace, adapter, sink=stream, progress=progress))
            n = out.tell()
        stages = {"RSS at each tenth of the requests done": curve}
    else:
        stages = _stages(trace_dir, stream=mode == "read")
    peak = stages.pop("peak", None) or _status_mb("VmHWM")      # read modes reset VmHWM
    return {"wall_s": time.perf_counter() - t0, "json_chars": n, "stages": stages,
            "peak_rss_mb": peak}


def _trace_dir(work: Path, hours: int, limit: int | None, geometry: str) -> Path:
    """The N-hour trace in ``work``, written once (``day_trace.py``)."""
    name = f"{hours}h" + (f"-first{limit}" if limit else "") + f"-{geometry}"
    tdir = work / name
    if not (tdir / "header.json").exists():
        t0 = time.perf_counter()
        write_day(hours, limit, geometry, tdir)
        print(f"wrote {tdir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return tdir


def _line(label: str, mode: str, r: dict, real_s: float | None) -> str:
    speed = f"{real_s / r['wall_s']:7.1f}x" if real_s and mode == "replay" else "       -"
    shown = {"read": "read", "whole": "read whole", "replay": "replay"}[mode]
    return (f"{label} {shown:<10} wall {r['wall_s']:8.1f} s {speed} real time, peak RSS "
            f"{r['peak_rss_mb']:7.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--limit", type=int, help="first N requests of the hour only")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="full-attention-b16")
    ap.add_argument("--modes", default="read,replay",
                    help="read (streamed, no vLLM), whole (read whole, no vLLM), replay")
    ap.add_argument("--work", type=Path, help="where the traces are written once and reused "
                                              "(default: a new temporary folder)")
    ap.add_argument("--trace", type=Path, help="measure this trace directory alone")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    modes = args.modes.split(",")
    if args.trace is not None:
        runs = [(str(args.trace), args.trace, None)]
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="replayer-day-"))
        work.mkdir(parents=True, exist_ok=True)
        first = f" (first {args.limit})" if args.limit else ""
        runs = [(f"{args.geometry} {h:>2} h{first}", _trace_dir(work, h, args.limit, args.geometry),
                 h * HOUR_MS / 1000 if args.limit is None else None) for h in (1, args.hours)]
    figures = {}
    for label, tdir, real_s in runs:
        for mode in modes:
            r = run_child(__file__, mode, tdir)
            figures[(mode, label)] = r
            print(_line(label, mode, r, real_s), flush=True)
            if mode == "replay":
                print("    RSS at each tenth of the requests done (MB): " + " ".join(
                    map(str, r["stages"]["RSS at each tenth of the requests done"])), flush=True)
            else:
                print("    stage peaks above what was held before (MB): " + ", ".join(
                    f"{k} {v:g}" for k, v in r["stages"].items()), flush=True)
    if len(runs) == 2:
        for mode in modes:
            one, many = (figures[(mode, label)] for label, _, _ in runs)
            target = " (target <= 1.10)" if mode == "replay" else ""
            print(f"{mode}: peak RSS {args.hours} h / 1 h = "
                  f"{many['peak_rss_mb'] / one['peak_rss_mb']:.3f}{target}")


if __name__ == "__main__":
    main()
