"""Benchmark: the model worker beside the null executor over every fixture it runs.

Replays each fixture under ``fixtures/`` the model worker can run (the others
are listed with the reason) on one environment's vLLM twice, with the null
executor and with ``--worker model``, each worker in one engine process that
serves every fixture in turn (so "warm" is a replay in a process that has
imported vLLM already; "cold" adds that process's start, said once per
worker). Prints per fixture both wall times (engine build included), the
block size, the engine steps and the model worker's milliseconds per step (its
step loop's time, the engine's build left out), and
whether the hits, the schedule, the store and the KV-cache events agree
(:func:`replayer.compare.workers.worker_differences`), then the totals. A
fixture the model worker or this vLLM release refuses is listed with the
reason.

    python benchmarks/worker_agreement.py [--engine .venv-serve] [--set K=V ...] [--all] [FIXTURE ...]

A fixture of more than ``LONG_TOKENS`` prompt tokens (``traces/conversation_500``:
7.1 M) would run for hours through a real model on two cores: listed with its
size and left out unless named or ``--all`` is given.

``--set`` changes every fixture's engine block as ``replayer run --set`` does
(e.g. ``engine.block_size=32`` beside the fixtures' 16, to price the CPU
kernel's vec16 path per step).

On a GPU machine, ``--engine installed`` runs the CUDA vLLM's own worker.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replayer.compare.workers import worker_differences  # noqa: E402
from replayer.replay.engines import UnsupportedByEngine, check_supported  # noqa: E402
from replayer.replay.engines.sources.specs import parse_spec, resolve  # noqa: E402
from replayer.replay.execution.clients import cold_client  # noqa: E402
from replayer.replay.engines.worker.models import refusal  # noqa: E402
from traces import load_target  # noqa: E402
from traces.scenarios.what_if import with_sets  # noqa: E402


#: Prompt tokens above which a fixture is left out of the default run (hours on 2 cores).
LONG_TOKENS = 1_000_000


def prompt_tokens(trace) -> int:
    """The trace's prompt tokens, all requests together."""
    return int(trace.requests["num_prompt_tokens"].to_numpy().sum())


def fixture_paths() -> list[Path]:
    """Every scenario and trace directory under fixtures/, sorted."""
    found = [p for p in (ROOT / "fixtures").rglob("*.yaml")]
    found += [p.parent for p in (ROOT / "fixtures").rglob("header.json")]
    return sorted(set(found))


def _drop_release_refusals(runnable: list, skipped: list, info) -> None:
    """Move to ``skipped`` what the engine's release itself refuses (e.g. a
    setting it removed), with the reason it gives."""
    for p, trace in list(runnable):
        try:
            check_supported(info.vllm, trace.engine, info.label, "model")
        except UnsupportedByEngine as e:
            runnable.remove((p, trace))
            skipped.append((p, str(e).removeprefix(f"{info.label}: ")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", nargs="*", type=lambda s: Path(s).resolve())
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    ap.add_argument("--set", action="append", dest="sets", metavar="K=V")
    ap.add_argument("--all", action="store_true",
                    help=f"also the fixtures of more than {LONG_TOKENS:,} prompt tokens")
    args = ap.parse_args()
    paths = [p.resolve() for p in args.fixtures] or fixture_paths()
    runnable, skipped = [], []
    for p in paths:
        trace = with_sets(load_target(p), args.sets)
        why = refusal(trace.engine)
        tokens = prompt_tokens(trace)
        if why is None and tokens > LONG_TOKENS and not (args.all or args.fixtures):
            why = (f"not run by default: {tokens:,} prompt tokens through a real model "
                   "(hours on 2 cores; name it or pass --all)")
        (skipped if why else runnable).append((p, why or trace))
    clients = {}
    starts = {}
    for worker in ("null", "model"):
        t = time.perf_counter()
        clients[worker] = cold_client(resolve(parse_spec(args.engine, worker)), own_process=True)
        starts[worker] = time.perf_counter() - t
    _drop_release_refusals(runnable, skipped, clients["model"].info)
    print(f"engine {args.engine}: {len(runnable)} fixture(s) the model worker runs, "
          f"{len(skipped)} it does not")
    print(f"{'fixture':58s} {'null s':>7s} {'model s':>8s} {'block':>5s} {'steps':>5s} "
          f"{'ms/step':>7s}  agreement")
    totals = {"null": 0.0, "model": 0.0}
    agree = 0
    try:
        for p, trace in runnable:
            results = {}
            for worker in ("null", "model"):
                t = time.perf_counter()
                results[worker] = clients[worker](trace)
                took = time.perf_counter() - t
                results[worker].timings["bench_s"] = took
                totals[worker] += took
            diffs = worker_differences(results["null"], results["model"])
            agree += not diffs
            model = results["model"]
            print(f"{str(p.relative_to(ROOT)):58s} {results['null'].timings['bench_s']:7.1f} "
                  f"{model.timings['bench_s']:8.1f} {trace.engine.kv_groups[0].block_size:5d} "
                  f"{model.steps:5d} {1000 * model.timings['loop_s'] / max(model.steps, 1):7.0f}  "
                  f"{'identical' if not diffs else 'DIFFERS: ' + '; '.join(diffs[:3])}",
                  flush=True)
    finally:
        for c in clients.values():
            c.close()
    print(f"{'total (warm)':58s} {totals['null']:7.1f} {totals['model']:8.1f} {'':17s}  "
          f"{agree}/{len(runnable)} identical")
    print(f"first replay's process start (cold, imports before the first engine): not "
          f"separated from the first fixture above; clients opened in "
          f"{starts['null']:.1f} s / {starts['model']:.1f} s")
    for p, why in skipped:
        print(f"  not on the model worker: {p.relative_to(ROOT)}: {why}")
    return 0 if agree == len(runnable) else 1


if __name__ == "__main__":
    sys.exit(main())
