"""Benchmark: what ``check --recompute`` costs beside a plain model-worker replay.

For each fixture the model worker runs (or those named), in one model-worker
engine process on an environment's vLLM: the plain replay's wall seconds, the
recompute's (every hit request replayed cold twice: the reference and the
calibration), their ratio, the calibrated tolerance and threshold, and the
verdicts. Prints a table and the totals.

    python benchmarks/recompute_cost.py [--engine .venv-serve] [FIXTURE ...]
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

from replayer.check.recompute import recompute_check  # noqa: E402
from replayer.replay.engines.sources.specs import parse_spec, resolve  # noqa: E402
from replayer.replay.execution.clients import cold_client  # noqa: E402
from replayer.replay.engines.worker.models import refusal  # noqa: E402
from traces import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", nargs="*", type=Path)
    ap.add_argument("--engine", default=str(ROOT / ".venv-serve"))
    args = ap.parse_args()
    paths = [p.resolve() for p in args.fixtures] or fixture_paths()
    traces = [(p, load_target(p)) for p in paths]
    traces = [(p, t) for p, t in traces if refusal(t.engine) is None]
    client = cold_client(resolve(parse_spec(args.engine, "model")), own_process=True)
    print(f"{'fixture':52s} {'plain s':>8s} {'recompute s':>12s} {'ratio':>6s} "
          f"{'hits':>5s} {'tolerance':>10s} {'threshold':>10s}  verdicts")
    totals = [0.0, 0.0]
    try:
        for p, trace in traces:
            t = time.perf_counter()
            result = client(trace)
            plain = time.perf_counter() - t
            t = time.perf_counter()
            report = recompute_check(trace, result, client)
            extra = time.perf_counter() - t
            totals[0] += plain
            totals[1] += plain + extra
            wrong = len(report.wrong)
            verdict = "no hits" if not report.verdicts else (
                f"{len(report.verdicts) - wrong} match" + (f", {wrong} WRONG" if wrong else ""))
            print(f"{str(p.relative_to(ROOT)):52s} {plain:8.1f} {plain + extra:12.1f} "
                  f"{(plain + extra) / plain:6.2f} {len(report.verdicts):5d} "
                  f"{report.tolerance:10.3g} {report.threshold:10.3g}  {verdict}", flush=True)
    finally:
        client.close()
    print(f"{'total':52s} {totals[0]:8.1f} {totals[1]:12.1f} {totals[1] / totals[0]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
