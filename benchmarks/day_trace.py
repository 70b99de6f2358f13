"""A day of traffic from the Mooncake conversation hour: the hour repeated.

Copy ``c`` of the hour arrives ``c`` hours (3,600,000 ms) after the first and
has fresh prefixes (every hash id shifted past all ids of earlier copies), so
no copy hits another's cache: each hour of the day costs what the first did.
Used by ``replay_day.py``; the trace is written once and kept (``--out``).

    python benchmarks/day_trace.py --hours 24 --out /tmp/day      # the whole day
    python benchmarks/day_trace.py --hours 2 --limit 1000 --out /tmp/day2k
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from replay_conversation import GEOMETRIES, SOURCE  # noqa: E402

HOUR_MS = 3_600_000


def day_jsonl(source: Path, hours: int, limit: int | None, out: Path) -> Path:
    """The first ``limit`` lines of ``source``, ``hours`` times, shifted in time and ids."""
    lines = []
    with source.open() as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            lines.append(json.loads(line))
    span = max(x for rec in lines for x in rec["hash_ids"]) + 1
    with out.open("w") as fh:
        for c in range(hours):
            for rec in lines:
                fh.write(json.dumps({**rec, "timestamp": rec["timestamp"] + c * HOUR_MS,
                                     "hash_ids": [x + c * span for x in rec["hash_ids"]]}))
                fh.write("\n")
    return out


def write_day(hours: int, limit: int | None, geometry: str, out: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from traces.importers.mooncake import import_mooncake
    from traces.trace import write_trace

    with tempfile.TemporaryDirectory() as tmp:
        src = day_jsonl(SOURCE, hours, limit, Path(tmp) / "day.jsonl")
        trace = import_mooncake(src, engine=GEOMETRIES[geometry])
    return write_trace(trace, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--limit", type=int, help="first N requests of the hour only")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="full-attention-b16")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    print(write_day(args.hours, args.limit, args.geometry, args.out))


if __name__ == "__main__":
    main()
