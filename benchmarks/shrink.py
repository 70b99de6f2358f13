"""``replayer shrink`` figures: probes, wall time, sizes before/after, for

* the planted #51295 case: the pair (turn1 24577 tokens, turn2 50000 sharing
  it) among unrelated traffic in the same hybrid geometry
  (tests/test_shrink.py ``planted``), shrunk with ``--diff vllm==0.29.0
  installed --request turn2``;
* a real loss in a recording: ``fixtures/traces/live_eagle`` (100 requests
  from a real ``vllm serve``), the EAGLE drop of ``cmpl-r0002-0-9038f593``
  (``--lost-by eagle_drop``), as docs/shrink.md shows it.

Start a warm server first (``replayer server start --engine installed
--engine vllm==0.29.0``): cold, every probe pays vLLM's imports.

    .venv/bin/python benchmarks/shrink.py [--noise 24] [--timeout S] [--max-probes N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    from test_shrink import planted

    ap = argparse.ArgumentParser()
    ap.add_argument("--noise", type=int, default=24)
    ap.add_argument("--timeout", type=float, help="passed to shrink (best so far written)")
    ap.add_argument("--max-probes", type=int, help="passed to shrink")
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
            print(f"{name}: {n_in} requests in, {len(kept)} out ({', '.join(kept)}), "
                  f"wall {wall:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
