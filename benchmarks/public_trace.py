"""Where the benchmarks find the whole public Mooncake conversation trace.

The repository ships only its first 500 lines (fixtures/mooncake/, for the
tests); the benchmarks want all 12,031 requests. The file is, in this order:
``--trace FILE``, ``$PREFIX_REPLAYER_MOONCAKE_TRACE``, or
``../shared/traces/mooncake_conversation_trace.jsonl`` beside the checkout
when present. Missing: one line saying where to get it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# These benchmarks measure a replay in its own process (start-up, peak RSS):
# never on a warm server that happens to run (benchmarks/warm_start.py measures that).
os.environ["PREFIX_REPLAYER_NO_SERVER"] = "1"

ENV = "PREFIX_REPLAYER_MOONCAKE_TRACE"
BESIDE_CHECKOUT = (Path(__file__).resolve().parents[2] / "shared" / "traces"
                   / "mooncake_conversation_trace.jsonl")
WHERE_FROM = ("the Mooncake FAST'25 trace release, github.com/kvcache-ai/Mooncake, "
              "FAST25-release/traces/conversation_trace.jsonl (Apache-2.0)")


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", metavar="FILE",
                    help=f"the Mooncake conversation trace (JSONL); default ${ENV}, "
                         f"else {BESIDE_CHECKOUT} when present")


def trace_path(args: argparse.Namespace) -> Path:
    """The trace to read, or exit 2 with one line naming what is missing."""
    given = args.trace or os.environ.get(ENV)
    path = Path(given).expanduser() if given else BESIDE_CHECKOUT
    if not path.is_file():
        how = (f"--trace {given}" if args.trace else f"${ENV}={given}" if given
               else f"the default {path}")
        print(f"{Path(sys.argv[0]).name}: error: {how}: no such file; the benchmark needs the "
              f"whole Mooncake conversation trace, from {WHERE_FROM}; pass --trace FILE or set "
              f"{ENV}", file=sys.stderr)
        sys.exit(2)
    return path


def parse_or_run_child(ap: argparse.ArgumentParser, child) -> tuple[argparse.Namespace, Path]:
    """The benchmark's arguments and trace; a measuring child (``--child MODE
    DIR``, run in a fresh process so start-up and peak RSS are its own) instead
    prints ``child(MODE, DIR)``'s figures as one JSON line and exits."""
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    add_argument(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        sys.exit(0)
    return args, trace_path(args)


def run_child(script: str, mode: str, trace_dir: Path, hash_seed: int = 0) -> dict:
    """Run ``script --child MODE DIR`` in a fresh process (this checkout and
    ``benchmarks/`` importable, ``PYTHONHASHSEED=hash_seed``) and return the
    figures its last line prints; a failing child stops the benchmark with
    the tail of its stderr."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed),
               PYTHONPATH=f"{root}:{root / 'benchmarks'}")
    out = subprocess.run([sys.executable, script, "--child", mode, str(trace_dir)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{mode} on {trace_dir} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
