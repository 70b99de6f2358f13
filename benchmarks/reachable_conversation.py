"""Reachable prefix hits of the whole Mooncake conversation trace, from the trace alone.

Prints the share of prompt tokens an infinite cache could serve
(:func:`traces.reachable.reachable_hits`: 16-token units, the last prompt token
recomputed, same salt), the seconds and peak RSS it took, and beside it the
same trace counted Mooncake's way (FAST'25): the share of 512-token blocks whose
hash id was seen in an earlier request, so the two can be compared.

    python benchmarks/reachable_conversation.py [--limit N] [--source FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def block_hit_ratio(path: Path, limit: int | None) -> tuple[float, float]:
    """(blocks whose hash id appeared before / all blocks, the same weighted by tokens)."""
    seen: set[int] = set()
    hit = total = hit_tok = tok = 0
    with path.open() as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            n = rec["input_length"]
            for j, h in enumerate(rec["hash_ids"]):
                size = min(512, n - 512 * j)
                total += 1
                tok += size
                if h in seen:
                    hit += 1
                    hit_tok += size
            seen.update(rec["hash_ids"])
    return hit / total, hit_tok / tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--source", type=Path, default=SOURCE, help="the trace (JSON lines)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from traces.importers.mooncake import import_mooncake
    from traces.reachable import reachable_hits

    trace = import_mooncake(args.source, limit=args.limit)
    t0 = time.perf_counter()
    df = reachable_hits(trace)
    secs = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reach, prompt = int(df["reachable"].sum()), int(df["num_prompt_tokens"].sum())
    blocks, block_tokens = block_hit_ratio(args.source, args.limit)
    print(f"requests {df.height}, prompt tokens {prompt}")
    print(f"reachable (infinite cache, 16-token units, last token recomputed): "
          f"{reach} tokens = {reach / prompt:.2%}  ({secs:.1f} s, peak RSS {rss:.0f} MB)")
    print(f"Mooncake's count: 512-token blocks whose hash id was seen before: "
          f"{blocks:.2%} of blocks, {block_tokens:.2%} of tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
