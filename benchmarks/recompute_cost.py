"""Benchmark: what ``check --recompute`` costs beside a plain model-worker replay.

For each fixture the model worker runs (or those named), in one model-worker
engine process on an environment's vLLM: the plain replay's wall seconds (the
engine's default threads), the whole ``check --recompute``'s (the hit replay at
one thread with its schedule logged, then every hit request replayed cold twice
at one thread: the hit-shaped reference and the looser one, side by side in a
second engine process as ``check`` runs them, or one after the other with
``--sequential``), their ratio, the
looser reference's tolerance and threshold, and the verdicts. With
``--residue``, one line per hit: the contract it was held to and its largest
difference from its hit-shaped reference in units in the last place of the
model's compute dtype (what sets ``reference.RESIDUE_UNITS``). Prints a table
and the totals. The engine process replays the first fixture once untimed
first, so that no row pays its start.

    python benchmarks/recompute_cost.py [--engine .venv-serve] [--residue] [--sequential] [FIXTURE ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_agreement import fixture_paths  # noqa: E402

from replayer.check.recompute import hit_replay, recompute_check  # noqa: E402
from replayer.check.reference import unit  # noqa: E402
from replayer.replay.engines.sources.specs import parse_spec, resolve  # noqa: E402
from replayer.replay.execution.clients import beside, cold_client  # noqa: E402
from replayer.replay.engines.worker.models import refusal  # noqa: E402
from traces import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", nargs="*", type=Path)
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    ap.add_argument("--residue", action="store_true",
                    help="one line per hit: its contract and difference in dtype units")
    ap.add_argument("--sequential", action="store_true",
                    help="the two references one after the other in one engine process")
    args = ap.parse_args()
    paths = [p.resolve() for p in args.fixtures] or fixture_paths()
    traces = [(p, load_target(p)) for p in paths]
    traces = [(p, t) for p, t in traces if refusal(t.engine) is None]
    client = cold_client(resolve(parse_spec(args.engine, "model")), own_process=True)
    second = None if args.sequential else beside(client)
    side = None if second is None else second.__enter__()
    if traces:
        client(traces[0][1])                        # the engine process's start, untimed
    print(f"references: {'one after the other' if side is None else 'side by side'}")
    print(f"{'fixture':52s} {'plain s':>8s} {'recompute s':>12s} {'ratio':>6s} "
          f"{'hits':>5s} {'tolerance':>10s} {'threshold':>10s}  verdicts")
    totals = [0.0, 0.0]
    try:
        for p, trace in traces:
            t = time.perf_counter()
            result = client(trace)
            plain = time.perf_counter() - t
            t = time.perf_counter()
            hits, log = hit_replay(trace, client)
            report = recompute_check(trace, hits, client, log, side=side)
            extra = time.perf_counter() - t
            totals[0] += plain
            totals[1] += extra
            wrong = len(report.wrong)
            verdict = "no hits" if not report.verdicts else (
                f"{len(report.verdicts) - wrong} match" + (f", {wrong} WRONG" if wrong else ""))
            print(f"{str(p.relative_to(ROOT)):52s} {plain:8.1f} {extra:12.1f} "
                  f"{extra / plain:6.2f} {len(report.verdicts):5d} "
                  f"{report.tolerance:10.3g} {report.threshold:10.3g}  {verdict}", flush=True)
            if args.residue:
                for v in report.verdicts:
                    scale = max((abs(x) for x in hits.by_id()[v.id].logprobs or []), default=1.0)
                    print(f"    {v.id}: {v.divergence / unit(scale, report.dtype):.0f} units "
                          f"of {report.dtype} ({v.divergence:.3g}); {v.contract}", flush=True)
    finally:
        if second is not None:
            second.__exit__(None, None, None)
        client.close()
    print(f"{'total':52s} {totals[0]:8.1f} {totals[1]:12.1f} {totals[1] / totals[0]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
