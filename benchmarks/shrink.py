"""``replayer shrink`` figures: probes, wall time, sizes before/after, for

* the planted #51295 case: the pair (turn1 24577 tokens, turn2 50000 sharing
  it) among unrelated traffic in the same hybrid geometry
  (tests/test_shrink.py ``planted``), shrunk with ``--diff vllm==0.29.0
  installed --request turn2``;
* a real loss in a recording: ``fixtures/traces/live_eagle`` (100 requests
  from a real ``vllm serve``), the EAGLE drop of ``cmpl-r0002-0-9038f593``
  (``--lost-by eagle_drop``), as docs/shrink.md shows it;
* a real loss in the first ``--slice`` (1,000) requests of the Mooncake
  conversation trace in the hybrid #51295 geometry: ``replayer explain``
  names the request that loses the most tokens to one cause, and shrink keeps
  that loss (``--lost-by CAUSE --at-least N``); ``--slice 0`` skips it (it
  needs the whole trace: ``--trace FILE``, as the other benchmarks).

Start a warm server first (``replayer server start --engine installed
--engine vllm==0.29.0``): cold, every probe pays vLLM's imports.

    .venv/bin/python benchmarks/shrink.py [--noise 24] [--slice 1000] [--timeout S]
                                          [--max-probes N] [--trace FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

_server = os.environ.get("PREFIX_REPLAYER_NO_SERVER")
import public_trace  # noqa: E402  (it turns the warm server off: the probes want it)
from replay_conversation import GEOMETRIES  # noqa: E402

if _server is None:
    os.environ.pop("PREFIX_REPLAYER_NO_SERVER", None)


def slice_loss(tmp: Path, source: Path, limit: int,
               cause: str | None) -> tuple[str, list[str], int]:
    """The slice as a trace directory, and the loss explain finds largest there:
    (trace, the shrink property's options, requests)."""
    import polars as pl

    from replayer.analysis.explain import CAUSES
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    engine = GEOMETRIES["hybrid-b1536-pmu128-eagle"]
    trace = write_trace(import_mooncake(source, limit=limit, engine=engine), tmp / "slice")
    table = tmp / "explain.parquet"
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "replayer", "explain", str(trace), "--top", "0",
                           "--parquet", str(table), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"explain on the slice failed:\n{proc.stderr[-3000:]}")
    rows = pl.read_parquet(table)
    # A capacity loss needs the load around it, so by default the largest loss to a
    # cause of prefix reuse itself (the EAGLE drop, retention, alignment, ...).
    causes = [cause] if cause else [c for c in CAUSES if c not in ("unexplained", "capacity")]
    best = max(((int(r[f"lost_{c}"]), r["id"], c) for r in rows.iter_rows(named=True)
                for c in causes), key=lambda x: (x[0], x[1]))
    lost, rid, cause = best
    print(f"slice: {limit} requests, explain {time.monotonic() - t:.1f} s; the largest loss: "
          f"{rid} loses {lost} token(s) to {cause}", flush=True)
    return str(trace), ["--request", rid, "--lost-by", cause, "--at-least", str(lost)], limit


def main() -> int:
    from test_shrink import planted

    ap = argparse.ArgumentParser()
    ap.add_argument("--noise", type=int, default=24)
    ap.add_argument("--timeout", type=float, help="passed to shrink (best so far written)")
    ap.add_argument("--max-probes", type=int, help="passed to shrink")
    ap.add_argument("--slice", type=int, default=1000,
                    help="requests of the conversation trace for the real-loss case (0: skip)")
    ap.add_argument("--cause", help="the slice's loss to shrink: the largest to this cause "
                                    "(default: the largest to any cause but capacity)")
    ap.add_argument("--slice-only", action="store_true", help="skip the planted cases")
    public_trace.add_argument(ap)
    args = ap.parse_args()
    limits = ([] if args.timeout is None else ["--timeout", str(args.timeout)]) + (
        [] if args.max_probes is None else ["--max-probes", str(args.max_probes)])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "planted.yaml"
        data = planted(args.noise)
        src.write_text(yaml.safe_dump(data, sort_keys=False))
        cases = [("planted #51295", str(src), len(data["requests"]),
                  ["--diff", "vllm==0.29.0", "installed", "--request", "turn2"]),
                 ("live_eagle eagle_drop", str(REPO / "fixtures/traces/live_eagle"), 100,
                  ["--request", "cmpl-r0002-0-9038f593", "--lost-by", "eagle_drop"])]
        if args.slice_only:
            cases = []
        if args.slice:
            target, prop, n_in = slice_loss(Path(tmp), public_trace.trace_path(args), args.slice,
                                            args.cause)
            cases.append((f"conversation slice {prop[3]}", target, n_in, prop))
        for name, target, n_in, prop in cases:
            out = Path(tmp) / "repro.yaml"
            t = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "replayer", "shrink", target, "-o",
                                   str(out), *prop, *limits],
                                  cwd=REPO, capture_output=True, text=True)
            wall = time.monotonic() - t
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            print(proc.stdout.strip())
            kept = [r["id"] for r in yaml.safe_load(out.read_text())["requests"]]
            if len(kept) > 12:
                kept = kept[:5] + ["..."] + kept[-2:]
            print(f"{name}: {n_in} requests in, {len(kept)} out ({', '.join(kept)}), "
                  f"wall {wall:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
