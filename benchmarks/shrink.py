"""``replayer shrink`` on the planted #51295 case: probes, wall time, sizes before/after.

The pair (turn1 24577 tokens, turn2 50000 sharing it) among unrelated
traffic in the same hybrid geometry (tests/test_shrink.py ``planted``),
shrunk with ``--diff vllm==0.29.0 installed --request turn2``. Start a warm
server first (``replayer server start --engine installed --engine
vllm==0.29.0``): cold, every probe pays vLLM's imports.

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
        src, out = Path(tmp) / "planted.yaml", Path(tmp) / "repro.yaml"
        data = planted(args.noise)
        src.write_text(yaml.safe_dump(data, sort_keys=False))
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "replayer", "shrink", str(src), "-o", str(out),
                               "--diff", "vllm==0.29.0", "installed", "--request", "turn2", *limits],
                              cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        print(proc.stdout.strip())
        kept = [r["id"] for r in yaml.safe_load(out.read_text())["requests"]]
        print(f"planted case: {len(data['requests'])} requests in, {len(kept)} out "
              f"({', '.join(kept)}), wall {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
