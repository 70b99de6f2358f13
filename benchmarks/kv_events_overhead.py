"""What collecting vLLM's KV-cache events costs a replay: the same trace with
events off and on (``run --kv-events``), wall seconds, rows, peak RSS.

    python benchmarks/kv_events_overhead.py [TRACE]   (default fixtures/traces/conversation_500)

Each replay runs in its own ``python -m replayer run`` child (the CLI's pinned
hash seed), so the figures include vLLM's start-up, the same for both.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def run(trace: Path, events: Path | None) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB of the child)."""
    args = [sys.executable, "-m", "replayer", "run", str(trace), "--no-progress"]
    if events is not None:
        args += ["--kv-events", str(events)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


def main() -> int:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "fixtures/traces/conversation_500"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kv_events.parquet"
        off_s, off_mb = run(trace, None)
        on_s, on_mb = run(trace, out)
        table = pq.read_table(out)
        size = out.stat().st_size
    print(f"trace: {trace}")
    print(f"events off: {off_s:.1f} s wall, peak RSS {off_mb:.0f} MB")
    print(f"events on:  {on_s:.1f} s wall, peak RSS {on_mb:.0f} MB (the larger of the two children "
          "so far)")
    print(f"kv_events: {table.num_rows} block rows, {size} bytes on disk "
          f"({size / max(table.num_rows, 1):.1f} bytes a row)")
    print(f"overhead: {100 * (on_s - off_s) / off_s:+.1f}% wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
