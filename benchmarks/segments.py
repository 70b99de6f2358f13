"""Benchmark: the conversation hour in time segments, and a 24-hour day projected.

For each geometry (full attention at block 16; the hybrid #51295 geometry) it
replays the Mooncake conversation hour (12,031 requests) as the command line
does, each in a fresh process:

* ``sequential``: ``replayer run HOUR --json FILE``;
* ``pool``: ``replayer run HOUR --segments 2 --json FILE`` (a local process pool);
* ``ray``: ``replayer run HOUR --segments 2 --ray --json FILE`` (a Ray instance
  started by the command, its start-up included);

and prints each wall time, the speed-up over the sequential run, what the
command said of its boundary, and whether the three ``--json`` outputs are
identical. Then the share of boundaries that match for warm-ups of 1, 2 and 5
minutes of trace time: one replay of the hour pausing at ``--boundaries``
points spread over it (the exact path's state digests), and for each warm-up
and point a replay from an empty engine started that long before the point
(``replayer.replay.segments.worker``, the code ``--segments`` runs), digests
compared. Last, from the measured figures, the projected wall time of a
24-hour day (``day_trace.py``: the hour 24 times, fresh prefixes) on 32 and 128
cores, with the assumptions it rests on, and with ``--day`` one measured run
of that day at K = 2 here (~45 minutes on two free cores).

Every figure is taken on a machine that may be shared: the load average
(``uptime``) is printed beside each measurement.

    python benchmarks/segments.py                       # both geometries, ~40 min
    python benchmarks/segments.py --geometry full-attention-b16 --day
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import public_trace  # noqa: E402  (benchmarks/, first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from replay_conversation import GEOMETRIES  # noqa: E402

WARM_UPS = ("1m", "2m", "5m")
HOUR_S = 3600


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_cli(args: list[str]) -> dict:
    """``python -m replayer ARGS`` in a fresh process: wall seconds, stderr, exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFIX_REPLAYER_NO_SERVER="1")
    env.pop("_PREFIX_REPLAYER_PINNED", None)
    before = load()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "replayer", *args, "--no-progress"], env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"replayer {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return {"wall_s": wall, "stderr": out.stderr, "load_before": before, "load_after": load()}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def segment_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("replayer: segments: ")]


def _match_child(trace_dir: str, spec: str) -> dict:
    """In this (fresh) process: digests of the exact path at ``boundaries`` points,
    and of a replay from an empty engine ``W`` before each, for each warm-up."""
    from replay_conversation import quiet_child

    quiet_child()
    import numpy as np

    from replayer.replay.engines.digest.release_0_33 import state_digest
    from replayer.replay.execution.in_process import engine_here
    from replayer.replay.loop import ReplayRun
    from replayer.replay.segments.plan import Segment, warm_up_steps
    from replayer.replay.segments.worker import trace_part
    from traces import read_trace

    opts = json.loads(spec)
    trace = read_trace(trace_dir)
    sized = trace.sized_engine()
    widths = {w: warm_up_steps(w, trace) for w in opts["warm_ups"]}
    points = np.unique(trace.requests["arrival_step"].to_numpy())
    usable = points[points >= max(widths.values())]
    n = opts["boundaries"]
    picks = sorted({int(usable[int(i * (len(usable) - 1) / (n + 1))]) for i in range(1, n + 1)})

    def digest(engine, run):
        return state_digest(engine, {"clock": run.clock, "idle": run.idle,
                                     "since_progress": run.since_progress})

    t0 = time.perf_counter()
    exact = {}
    with engine_here(trace) as engine:
        run = ReplayRun(trace, engine)
        for p in picks:
            assert run.run_to(p)
            exact[p] = digest(engine, run)
    exact_s = time.perf_counter() - t0
    shares: dict[str, dict] = {}
    for w, steps in widths.items():
        t0 = time.perf_counter()
        matched, differs = 0, {}
        for p in picks:
            part = trace_part(trace, Segment(1, p, None, p - steps), sized)
            with engine_here(part) as engine:
                run = ReplayRun(part, engine)
                assert run.run_to(p)
                d = digest(engine, run)
            if d["total"] == exact[p]["total"]:
                matched += 1
            else:
                for k in d:
                    if k != "total" and d[k] != exact[p][k]:
                        differs[k] = differs.get(k, 0) + 1
        shares[w] = {"steps": steps, "matched": matched, "of": len(picks),
                     "differing_sections": differs,
                     "seconds": round(time.perf_counter() - t0, 1)}
    return {"boundaries": picks, "exact_s": round(exact_s, 1), "shares": shares}


def match_shares(trace_dir: Path, boundaries: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0",
               PYTHONPATH=f"{ROOT}:{ROOT / 'benchmarks'}")
    spec = json.dumps({"boundaries": boundaries, "warm_ups": list(WARM_UPS)})
    out = subprocess.run([sys.executable, __file__, "--child", "match", str(trace_dir), spec],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"match shares on {trace_dir} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def projection(seq_s: float, startup_s: float, warm_s_per_min: float, share: float,
               cores: int, hours: int = 24, warm_min: float = 2.0) -> dict:
    """Projected wall seconds of ``hours`` of the hour on ``cores`` segments."""
    loop = (seq_s - startup_s) * hours
    segment = loop / cores + warm_s_per_min * warm_min
    # A failed boundary makes its predecessor replay on through the next segment:
    # with failures independent at rate (1 - share), the longest run of them among
    # ``cores - 1`` boundaries sets the wall time.
    fail = 1.0 - share
    longest = 0.0
    if fail > 0:
        import math
        longest = max(0.0, math.log(max(cores - 1, 1)) / -math.log(fail)) if fail < 1 else cores
    return {"cores": cores, "wall_s": startup_s + segment * (1 + longest),
            "sequential_s": startup_s + loop, "longest_failed_run": round(longest, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append")
    ap.add_argument("--work", type=Path, help="keep the traces here (reused when present)")
    ap.add_argument("--boundaries", type=int, default=11,
                    help="points of the hour the match share is measured at (11)")
    ap.add_argument("--skip-runs", action="store_true",
                    help="only the match shares (and the projection from --seq-s)")
    ap.add_argument("--day", action="store_true",
                    help="also replay the 24-hour day at --segments 2 (~45 min)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    public_trace.add_argument(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_match_child(args.child[1], args.child[2])))
        return
    source = public_trace.trace_path(args)
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    work = args.work or Path(tempfile.mkdtemp(prefix="replayer-segments-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, {load()} at the start", flush=True)
    measured = {}
    for name in args.geometry or list(GEOMETRIES):
        tdir = work / f"hour-{name}"
        if not tdir.exists():
            write_trace(import_mooncake(source, engine=GEOMETRIES[name]), tdir)
        print(f"\n== {name}: the conversation hour (12,031 requests)", flush=True)
        rows = {}
        if not args.skip_runs:
            runs = {"sequential": [], "pool": ["--segments", "2"],
                    "ray": ["--segments", "2", "--ray"]}
            for mode, extra in runs.items():
                out = work / f"{name}-{mode}.json"
                r = run_cli(["run", str(tdir), "--json", str(out), *extra])
                r["sha"] = sha(out)
                rows[mode] = r
                seq = rows["sequential"]["wall_s"]
                print(f"{mode:<11} {r['wall_s']:7.1f} s  {seq / r['wall_s']:5.2f}x  "
                      f"({r['load_before']} before, {r['load_after']} after)", flush=True)
                for line in segment_lines(r["stderr"]):
                    print(f"{'':<11} {line}", flush=True)
            same = len({r["sha"] for r in rows.values()}) == 1
            print(f"identical --json bytes (sequential, pool, ray): {'yes' if same else 'NO'}",
                  flush=True)
        m = match_shares(tdir, args.boundaries)
        print(f"match share over {len(m['boundaries'])} boundaries "
              f"(steps {m['boundaries'][0]}..{m['boundaries'][-1]}; the exact path's digests "
              f"took {m['exact_s']} s with its replay; {load()}):", flush=True)
        for w, s in m["shares"].items():
            differs = ", ".join(f"{k} {v}" for k, v in sorted(s["differing_sections"].items()))
            print(f"  warm-up {w:>3} ({s['steps']} steps): {s['matched']} of {s['of']} matched "
                  f"({s['seconds']} s for all its warm-ups){'; differing: ' + differs if differs else ''}",
                  flush=True)
        measured[name] = (rows, m)
    name = next(iter(measured))
    rows, m = measured[name]
    if rows:
        seq = rows["sequential"]["wall_s"]
        tiny = work / f"one-request-{name}"
        if not tiny.exists():
            write_trace(import_mooncake(source, limit=1, engine=GEOMETRIES[name]), tiny)
        startup = run_cli(["run", str(tiny)])["wall_s"]
        share = m["shares"]["2m"]["matched"] / m["shares"]["2m"]["of"]
        warm_per_min = (seq - startup) / 60        # replay seconds per minute of trace time
        print(f"\n== projection: a 24-hour day (day_trace.py) of {name}, warm-up 2m", flush=True)
        print(f"from: the hour's sequential {seq:.1f} s (start-up {startup:.1f} s: a one-request "
              f"run), a minute of "
              f"trace time ~{warm_per_min:.2f} s, match share {share:.0%} at 2m", flush=True)
        for cores in (32, 128):
            p = projection(seq, startup, warm_per_min, share, cores)
            print(f"  {cores:>3} cores ({cores} segments): {p['wall_s'] / 60:6.1f} min "
                  f"(sequential {p['sequential_s'] / 60:.0f} min, "
                  f"{p['sequential_s'] / p['wall_s']:.0f}x)", flush=True)
        print("assumes: every segment on a core of its own, each as fast as one of these; "
              "the day's hours cost what the measured hour does (day_trace.py repeats it with "
              "fresh prefixes); shipping each part and starting workers in parallel (one "
              "start-up); failed boundaries independent at the measured rate (the longest run "
              "of them sets the wall time); no time for the head's checks and assembly",
              flush=True)
    if args.day:
        from day_trace import write_day

        day = work / "day"
        if not day.exists():
            write_day(24, None, name, day)
        r = run_cli(["run", str(day), "--segments", "2", "--json", str(work / "day.json")])
        print(f"\n== the day at --segments 2 here: {r['wall_s'] / 60:.1f} min "
              f"({r['load_before']} before, {r['load_after']} after)", flush=True)
        for line in segment_lines(r["stderr"]):
            print(f"  {line}", flush=True)


if __name__ == "__main__":
    main()
