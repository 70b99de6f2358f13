"""Benchmark: what recording costs, on the first 1,000 conversation requests.

Replays the Mooncake conversation slice (full attention, block 16) through
vLLM's EngineCore twice per round, in fresh processes: plain, and with the
recorder installed (the same scheduler subclass ``vllm serve`` loads). It
prints the seconds spent inside ``EngineCore.step`` (schedule, the null
model, update_from_output: the engine core's step time) as wall time and as
the engine thread's CPU time, the recorder's own time inside and outside
step (steady where both A/B figures swing with whatever else the machine
runs), the writer thread's GIL-holding time (the part of its work that
could delay a step), peak RSS of each, the recorded trace's size on disk
per request and per store operation (from a MooncakeStore fixture), and whether the
recording replays to the same outcomes, schedule and keys (the 1,000-request
round trip).

    python benchmarks/record_overhead.py [--requests 1000] [--rounds 3]
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
from contextlib import ExitStack
from pathlib import Path

import public_trace  # noqa: E402  (benchmarks/, first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
STORE_FIXTURE = ROOT / "fixtures" / "store" / "resend_after_reset.yaml"
ENGINE = {"block_size": 16, "kv_groups": [{"kind": "full_attention"}],
          "max_num_batched_tokens": 8192, "max_num_seqs": 256,
          "num_gpu_blocks": 2 * 1024 * 1024 // 16}


def _setup() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _child(mode: str, trace_dir: str, out_dir: str | None) -> dict:
    _setup()
    from traces import load_target
    from replayer.replay.loop import replay
    from replayer.replay.execution.in_process import engine_here
    from replayer.replay.store import StoreSpec

    from replayer.recorder import scheduler as rec_sched
    from replayer.recorder import session as rec_session
    from replayer.recorder.install import recording_into

    hook_s = {"step": 0.0, "add": 0.0}      # recorder time on the engine thread
    for name in ("added", "scheduled", "updated", "finished", "aborted", "reset"):
        fn = getattr(rec_sched.SchedulerRecorder, name)

        def timed(*a, _fn=fn, _where="add" if name == "added" else "step", **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                hook_s[_where] += time.perf_counter() - t

        setattr(rec_sched.SchedulerRecorder, name, timed)
    writers = []
    opened = rec_session.SchedulerSession.__init__

    def keep(self, *a, **k):
        opened(self, *a, **k)
        writers.extend(self.writers.values())

    rec_session.SchedulerSession.__init__ = keep
    trace = load_target(trace_dir)
    store = StoreSpec("memory") if trace.engine.connector else None
    opened = ExitStack()
    adapter = opened.enter_context(engine_here(
        trace, store=store, recorder=recording_into(out_dir) if mode == "record" else None))
    step = adapter.step
    spent = [0.0, 0.0]

    def timed_step():
        t, c = time.perf_counter(), time.thread_time()
        try:
            return step()
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += time.thread_time() - c

    adapter.step = timed_step
    t0 = time.perf_counter()
    result = replay(trace, adapter)
    t_close = time.perf_counter()
    opened.close()                     # the recorder's last flush happens here
    close_s = time.perf_counter() - t_close
    return {"step_s": spent[0], "step_cpu_s": spent[1], "loop_s": t_close - t0,
            "close_s": close_s, "hook_step_s": hook_s["step"], "hook_add_s": hook_s["add"],
            "writer_cpu_s": sum(w.cpu_seconds for w in writers),
            "writer_gil_s": sum(w.gil_cpu_seconds for w in writers),
            "steps": result.steps,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(mode: str, trace_dir: Path, out_dir: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(trace_dir)]
    if out_dir is not None:
        cmd.append(str(out_dir))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fidelity(trace_dir: Path) -> str:
    code = ("import sys; sys.path.insert(0, %r); import os, logging; "
            "os.environ.setdefault('VLLM_LOGGING_LEVEL','ERROR'); "
            "logging.getLogger('vllm').setLevel(logging.ERROR); "
            "from traces.trace import read_trace; from replayer.check.recorded import check_against_recorded; "
            "from replayer.replay.store import StoreSpec; t = read_trace(%r); "
            "s = StoreSpec('memory') if t.engine.connector else None; "
            "lines, ok, _ = check_against_recorded(t, store=s); print(lines[0])") % (str(ROOT), str(trace_dir))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    return (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-500:]])[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs="+")
    public_trace.add_argument(ap)
    args = ap.parse_args()
    if args.child:
        mode, trace_dir, *out = args.child
        print(json.dumps(_child(mode, trace_dir, out[0] if out else None)))
        return
    source = public_trace.trace_path(args)
    _setup()
    from traces.importers.mooncake import import_mooncake
    from traces.scenarios.compile import compile_scenario
    from traces.trace import write_trace

    tmp = Path(tempfile.mkdtemp(prefix="record-overhead-"))
    src = write_trace(import_mooncake(source, limit=args.requests, engine=ENGINE), tmp / "conv")
    plain, rec = [], []
    for r in range(args.rounds):                 # alternate, so drift hits both alike
        plain.append(_run("plain", src, None))
        out = tmp / f"rec{r}"
        rec.append(_run("record", src, out))
    best_p = min(plain, key=lambda x: x["step_s"])
    best_r = min(rec, key=lambda x: x["step_s"])
    added = 100 * (best_r["step_s"] - best_p["step_s"]) / best_p["step_s"]
    cpu_p = min(r["step_cpu_s"] for r in plain)
    cpu_r = min(r["step_cpu_s"] for r in rec)
    base = best_p["step_s"]
    in_step = 100 * min(r["hook_step_s"] for r in rec) / base
    at_add = 100 * min(r["hook_add_s"] for r in rec) / base
    gil = 100 * min(r["writer_gil_s"] for r in rec) / base
    writer_cpu = min(r["writer_cpu_s"] for r in rec)
    out = tmp / "rec0"
    size = _du(out)
    print(f"conversation slice: {args.requests} requests, {best_p['steps']} engine steps, "
          f"null model, best of {args.rounds} rounds each")
    print(f"  EngineCore.step wall  plain {base:.2f} s   recording {best_r['step_s']:.2f} s   "
          f"added {added:+.2f}% (A/B: swings with whatever else the machine runs)")
    print(f"  engine thread CPU     plain {cpu_p:.2f} s   recording {cpu_r:.2f} s   added "
          f"{100 * (cpu_r - cpu_p) / cpu_p:+.2f}% (as noisy)")
    print(f"  per step              plain {1e3 * base / best_p['steps']:.3f} ms  "
          f"recording {1e3 * best_r['step_s'] / best_r['steps']:.3f} ms")
    print("  recording's own time, as % of plain step time (steady run to run):")
    print(f"    hooks inside step   {in_step:.2f}%  (schedule/update_from_output/_free_request)")
    print(f"    add_request hook    {at_add:.2f}%  (packing each prompt; between steps)")
    print(f"    writer thread GIL   {gil:.2f}%  (building Arrow columns; the rest of its "
          f"{writer_cpu:.2f} s CPU, Parquet encoding and fsync, releases the GIL)")
    print(f"    engine-critical     {in_step + at_add + gil:.2f}%  (upper bound: all three, as if "
          f"the writer always stalled a step, as it can only with a model that never waits "
          f"on a GPU)")
    print(f"  final flush at close  {best_r['close_s']:.2f} s (plain {best_p['close_s']:.2f} s)")
    print(f"  peak RSS              plain {best_p['rss_mb']:.0f} MB   recording "
          f"{best_r['rss_mb']:.0f} MB")
    print(f"  trace on disk         {size / 1e6:.2f} MB = {size / args.requests / 1e3:.1f} kB "
          f"per request (tokens included)")
    print(f"  round trip            {_fidelity(out)}")
    store_trace = write_trace(compile_scenario(STORE_FIXTURE), tmp / "store")
    _run("record", store_trace, tmp / "store_rec")
    ops_dir = tmp / "store_rec" / "store_ops"
    from traces.trace import read_trace

    n_ops = read_trace(tmp / "store_rec").store_ops.num_rows
    print(f"  store ops             {n_ops} ops in {_du(ops_dir)} bytes = "
          f"{_du(ops_dir) / n_ops:.1f} bytes per op ({STORE_FIXTURE.name})")
    print(f"  store round trip      {_fidelity(tmp / 'store_rec')}")


if __name__ == "__main__":
    main()
