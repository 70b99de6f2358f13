"""Benchmark: this replayer beside aisimulate, the fastest peer, on the same traces.

aisimulate (ai-dynamo; a Rust re-implementation of vLLM's scheduler and KV-cache
manager) replays Mooncake-format traces too. Both sides get the same engine
(full attention, block 16, a 2 M-token cache, 8192 batched tokens, 256
sequences) on two traces:

* ``conversation``: the Mooncake conversation hour (12,031 requests; see
  benchmarks/public_trace.py for where it is read from), or its first
  ``--limit`` requests;
* ``long-prefix``: a Mooncake-format trace this script writes, deterministically
  (:func:`long_prefix_trace`): ~4,000 long prompts (~15 k tokens) that share long
  prefixes (documents picked by a Zipf law, conversations that come back with
  their whole history).

Each side runs as a child process, measured with every process under it
(:mod:`process_tree`: wall until the child exits; CPU seconds of the whole tree,
each process reaped with ``wait4``, this one their subreaper; peak MB the tree's
summed PSS sampled every 0.1 s, at least any one process's peak RSS): aisimulate's ``predict --capture-per-request`` and this project's
``replayer run TRACE --json FILE`` (the trace imported beforehand, its import
timed apart). Then every request's hit is compared (theirs
``first_admission_reused_input_tokens``, set once like vLLM's
``num_cached_tokens``), and each request whose hit differs is put in one
category (:func:`why_differs`), judged on each side's wait from arrival to
first admission: their clock counts milliseconds (``decode_ms`` 20 a step with
a decode, ``prefill_ms`` 0, from the first arrival), this project's counts
engine steps of ``step_ms`` 20 (every step, from the trace's zero).

    python benchmarks/peers.py                        # both traces, once each
    python benchmarks/peers.py --limit 1000 --requests 500   # a quick look
    python benchmarks/peers.py --trace-only long-prefix --write-trace FILE

aisimulate is not a dependency of this project: install it into a venv of its
own (``python3 -m venv .venv-peers && .venv-peers/bin/pip install --pre
'aisimulate>=0.13.0.dev0,<0.13.0a0'``, or the ``bench-peers`` extra) and pass
``--aisimulate PATH`` (default: ``$AISIMULATE``, ``.venv-peers/bin/aisimulate``,
then ``aisimulate`` on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

import process_tree  # noqa: E402  (benchmarks/, first on sys.path when run as a script)
import public_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEP_MS = 20
BLOCK = 16
KV_TOKENS = 2 * 1024 * 1024
MOONCAKE_BLOCK = 512
ENGINE = {"block_size": BLOCK, "kv_groups": [{"kind": "full_attention"}],
          "max_num_batched_tokens": 8192, "max_num_seqs": 256,
          "num_gpu_blocks": KV_TOKENS // BLOCK}


# -- the long-prefix trace -------------------------------------------------

def long_prefix_trace(path: Path, n: int = 4000, seed: int = 44) -> dict:
    """Write ``n`` Mooncake-format requests with long shared prefixes to ``path``.

    Deterministic in ``(n, seed)``. Each request is either a new conversation
    (a shared document of 8-48 blocks of 512 tokens, picked by a Zipf law from 48,
    then 1-6 blocks of its own) or, one time in three, the next turn of an earlier
    conversation still open (its whole prompt, its answer, a new question). Arrivals
    are a Poisson process at 4 requests a second. Returns its totals."""
    rng = np.random.default_rng(seed)
    n_docs = 48
    doc_len = rng.integers(8, 49, n_docs)
    weights = 1.0 / np.arange(1, n_docs + 1) ** 1.1
    weights /= weights.sum()
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    docs = [fresh(int(k)) for k in doc_len]
    open_convs: list[list[int]] = []          # block ids of each open conversation
    t = 0.0
    tokens = 0
    with path.open("w") as fh:
        for _ in range(n):
            t += rng.exponential(250.0)
            if open_convs and rng.random() < 1 / 3:
                j = int(rng.integers(len(open_convs)))
                blocks = open_convs[j] + fresh(int(rng.integers(1, 4)))
                if len(blocks) > 80 or rng.random() < 0.25:     # the conversation ends
                    open_convs.pop(j)
                else:
                    open_convs[j] = blocks
            else:
                blocks = docs[int(rng.choice(n_docs, p=weights))] + fresh(int(rng.integers(1, 7)))
                if rng.random() < 0.5:
                    open_convs.append(blocks)
                    if len(open_convs) > 64:
                        open_convs.pop(0)
            length = len(blocks) * MOONCAKE_BLOCK - int(rng.integers(0, MOONCAKE_BLOCK))
            tokens += length
            fh.write(json.dumps({"timestamp": int(t), "input_length": length,
                                 "output_length": int(rng.integers(16, 400)),
                                 "hash_ids": blocks}) + "\n")
    return {"requests": n, "prompt_tokens": tokens, "seconds": t / 1000}


# -- running each side -----------------------------------------------------

def timed_child(argv: list[str], env: dict | None = None) -> dict:
    """Run ``argv`` to the end: wall seconds, CPU seconds and peak memory (MB) of the
    child and every process under it (:func:`process_tree.run_tree`: CPU reaped
    from each, peak the tree's summed PSS sampled, at least any one's peak RSS); a
    failing child stops the benchmark with its stderr."""
    err = tempfile.TemporaryFile()
    code, figures = process_tree.run_tree(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
    if code:
        err.seek(0)
        sys.exit(f"{' '.join(argv[:3])} ... failed ({code}):\n"
                 f"{err.read().decode(errors='replace')[-3000:]}")
    return figures


def aisim_config(trace: Path, context_length: int) -> dict:
    """aisimulate's config for ENGINE: its block count is usable blocks (vLLM's N
    blocks hold one null block), a step with a decode costs ``STEP_MS``, a
    prefill-only step nothing."""
    return {
        "traffic": {"source": {"type": "trace", "paths": [str(trace)], "format": "mooncake",
                               "block_size": MOONCAKE_BLOCK},
                    "load": {"type": "trace_timestamps"}},
        "engine": {"mode": "aggregated", "model": "Qwen/Qwen3-32B-FP8", "hardware": "h200_sxm",
                   "backend": "vllm", "context_length": context_length,
                   "workers": {"aggregated": {
                       "scheduler": {"max_batched_tokens": ENGINE["max_num_batched_tokens"],
                                     "max_sequences": ENGINE["max_num_seqs"]},
                       "kv_cache": {"block_size": BLOCK, "prefix_caching": True,
                                    "capacity": {"type": "fixed",
                                                 "blocks": ENGINE["num_gpu_blocks"] - 1}},
                       "timing": {"type": "fixed", "prefill_ms": 0, "decode_ms": STEP_MS}}}},
    }


def run_aisim(exe: str, trace: Path, work: Path) -> tuple[dict, dict[int, dict]]:
    """aisimulate on ``trace``: its figures, and per request (0-based source line)
    its hit, arrival and first admission (ms)."""
    longest = max(json.loads(line)["input_length"] + json.loads(line)["output_length"]
                  for line in trace.open())
    cfg = work / "aisim.yaml"
    cfg.write_text(json.dumps(aisim_config(trace, max(longest + 16, 4096))))   # JSON is YAML
    out = work / "aisim-out"
    figures = timed_child([exe, "predict", "-c", str(cfg), "--output-dir", str(out),
                           "--overwrite", "--capture-per-request"])
    rows: dict[int, dict] = {}
    with (out / "requests.jsonl").open() as fh:
        for line in fh:
            r = json.loads(line)
            i = int(r["session_id"].removeprefix("request_")) - 1
            rows[i] = {"hit": r["first_admission_reused_input_tokens"],
                       "arrival_ms": r["arrival_time_ms"], "admit_ms": r["first_admit_ms"],
                       "status": r["terminal_status"]}
    return figures, rows


def run_ours(trace: Path, work: Path, limit: int | None) -> tuple[dict, dict, dict[int, dict]]:
    """Import (timed apart) and ``replayer run --json`` in children: the import's
    figures, the run's, and per request its hit, arrival and prefill step."""
    sys.path.insert(0, str(ROOT))
    tdir, out = work / "trace", work / "ours.json"
    engine_yaml = work / "engine.yaml"
    engine_yaml.write_text(json.dumps({"engine": ENGINE}))
    env = dict(os.environ, PREFIX_REPLAYER_NO_SERVER="1")
    imp = timed_child([sys.executable, "-m", "replayer", "import", "mooncake", str(trace),
                       "-o", str(tdir), "--engine", str(engine_yaml)]
                      + ([] if limit is None else ["--limit", str(limit)]), env)
    run = timed_child([sys.executable, "-m", "replayer", "run", str(tdir), "--json", str(out)],
                      env)
    data = json.loads(out.read_text())
    rows = {int(r["id"]): {"hit": r["num_cached_tokens"], "arrival_step": r["arrival_step"],
                           "prefill_step": r["prefill_step"], "finish_step": r["finish_step"]}
            for r in data["requests"]}
    run["steps"] = data["summary"]["steps"]
    return imp, run, rows


# -- comparing -------------------------------------------------------------

CATEGORIES = {
    "waited-longer-there": "admitted more than a step later after its arrival there than "
                           "here: their clock (a prefill-only step costs 0 ms, a step with a "
                           "decode STEP_MS) let other requests' blocks in or out first",
    "waited-longer-here": "admitted more than a step later after its arrival here than there "
                          "(this project's step clock: every step costs step_ms, "
                          "prefill-only ones included)",
    "same-wait-shorter-there": "admitted as soon after its arrival on both (within a step), "
                               "their hit shorter: the caches' contents differ (eviction "
                               "order, blocks not yet cached)",
    "same-wait-longer-there": "admitted as soon after its arrival on both (within a step), "
                              "their hit longer: the caches' contents differ (eviction order, "
                              "blocks not yet cached)",
    "missing-there": "no hit reported there (not completed)",
}


def waits(ours: dict, theirs: dict) -> tuple[int, float]:
    """Steps from arrival to the first prefill, here and there. Their clock counts
    milliseconds from the first arrival, ours steps from the trace's zero, so only
    the waits compare."""
    return (ours["prefill_step"] - ours["arrival_step"],
            (theirs["admit_ms"] - theirs["arrival_ms"]) / STEP_MS)


def why_differs(ours: dict, theirs: dict) -> str:
    """One category for a request whose hit differs (see CATEGORIES)."""
    if theirs.get("hit") is None or theirs.get("admit_ms") is None:
        return "missing-there"
    here, there = waits(ours, theirs)
    if there > here + 1:
        return "waited-longer-there"
    if here > there + 1:
        return "waited-longer-here"
    return "same-wait-shorter-there" if theirs["hit"] < ours["hit"] else "same-wait-longer-there"


def compare(ours: dict[int, dict], theirs: dict[int, dict]) -> dict:
    """Requests with equal hits, and the differing ones by category, with
    examples and the tokens by which hits differ in all."""
    same = 0
    cats: Counter = Counter()
    examples: dict[str, list] = {}
    tokens = 0
    for i in sorted(ours):
        o, t = ours[i], theirs.get(i, {})
        if t.get("hit") == o["hit"]:
            same += 1
            continue
        cat = why_differs(o, t)
        cats[cat] += 1
        tokens += abs((t.get("hit") or 0) - (o["hit"] or 0))
        if len(examples.setdefault(cat, [])) < 3:
            examples[cat].append((i, o["hit"], t.get("hit"))
                                 + (waits(o, t) if t.get("admit_ms") is not None else (None,)*2))
    return {"requests": len(ours), "same": same, "categories": cats, "examples": examples,
            "tokens_apart": tokens,
            "ours_cached": sum(o["hit"] or 0 for o in ours.values()),
            "theirs_cached": sum(theirs.get(i, {}).get("hit") or 0 for i in ours)}


# -- the benchmark ---------------------------------------------------------

def find_aisimulate(given: str | None) -> str:
    for cand in (given, os.environ.get("AISIMULATE"), str(ROOT / ".venv-peers/bin/aisimulate"),
                 shutil.which("aisimulate")):
        if cand and Path(cand).is_file():
            return cand
    print(f"{Path(sys.argv[0]).name}: error: aisimulate not found (--aisimulate PATH, "
          "$AISIMULATE, .venv-peers/bin/aisimulate or PATH); install it with `python3 -m venv "
          ".venv-peers && .venv-peers/bin/pip install --pre 'aisimulate>=0.13.0.dev0,<0.13.0a0'`",
          file=sys.stderr)
    sys.exit(2)


def side_by_side(name: str, source: Path, exe: str, work: Path, limit: int | None) -> dict:
    """One trace on both sides; returns the row the table prints."""
    work.mkdir(parents=True, exist_ok=True)
    trace = source
    if limit is not None:                     # aisimulate reads a whole file: cut it
        trace = work / "source.jsonl"
        with source.open() as src, trace.open("w") as dst:
            for k, line in enumerate(src):
                if k >= limit:
                    break
                dst.write(line)
    theirs_fig, theirs = run_aisim(exe, trace, work)
    imp, ours_fig, ours = run_ours(trace, work, None)
    return {"trace": name, "theirs": theirs_fig, "import": imp, "ours": ours_fig,
            "cmp": compare(ours, theirs)}


def print_row(row: dict) -> None:
    c, t, o = row["cmp"], row["theirs"], row["ours"]
    print(f"{row['trace']:<13} {c['requests']:>8} {t['wall_s']:>9.1f} {o['wall_s']:>8.1f} "
          f"{row['import']['wall_s']:>8.1f} {o['wall_s'] / t['wall_s']:>6.1f}x "
          f"{t['cpu_s']:>9.1f} {o['cpu_s']:>8.1f} {o['cpu_s'] / t['cpu_s']:>6.1f}x "
          f"{t['peak_rss_mb']:>9.0f} {o['peak_rss_mb']:>8.0f} "
          f"{c['same']:>6} {c['same'] / c['requests']:>7.2%} "
          f"{c['theirs_cached'] / max(1, c['ours_cached']):>8.4f}", flush=True)
    for cat, k in sorted(c["categories"].items(), key=lambda kv: -kv[1]):
        ex = "; ".join(f"#{i} here {h} after {wh} steps, there {th} after {wt} steps"
                       for i, h, th, wh, wt in c["examples"][cat])
        print(f"    {k:>6} {cat}: {CATEGORIES[cat]} (e.g. {ex})", flush=True)
    print(f"    tokens apart in all: {c['tokens_apart']}; steps here {o['steps']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aisimulate", metavar="PATH", help="the aisimulate command")
    ap.add_argument("--limit", type=int, metavar="N",
                    help="only the conversation trace's first N requests (default: all)")
    ap.add_argument("--requests", type=int, default=4000, metavar="N",
                    help="requests in the long-prefix trace (default 4000)")
    ap.add_argument("--trace-only", choices=["conversation", "long-prefix"],
                    help="only this trace")
    ap.add_argument("--write-trace", metavar="FILE",
                    help="write the long-prefix trace to FILE and exit")
    ap.add_argument("--work", metavar="DIR", help="keep traces and outputs here")
    public_trace.add_argument(ap)
    args = ap.parse_args()
    if args.write_trace:
        print(json.dumps(long_prefix_trace(Path(args.write_trace), args.requests)))
        return
    exe = find_aisimulate(args.aisimulate)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="replayer-peers-"))
    todo = [args.trace_only] if args.trace_only else ["conversation", "long-prefix"]
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; each side a child process "
          "with every process under it (CPU all of theirs, MB their summed PSS at its peak, "
          "sampled, at least any one's peak RSS); 'import s' is this project's import of the "
          "Mooncake file, outside its wall", flush=True)
    print(f"{'trace':<13} {'requests':>8} {'theirs s':>9} {'ours s':>8} {'import s':>8} "
          f"{'ratio':>7} {'their cpu':>9} {'our cpu':>8} {'ratio':>7} {'theirs MB':>9} {'ours MB':>8} {'equal':>6} {'equal %':>7} "
          f"{'cached':>8}", flush=True)
    for name in todo:
        if name == "conversation":
            source, limit = public_trace.trace_path(args), args.limit
        else:
            source, limit = work / "long-prefix.jsonl", None
            (work / name).mkdir(parents=True, exist_ok=True)
            long_prefix_trace(source, args.requests)
        print_row(side_by_side(name, source, exe, work / name, limit))
    print("ratio: ours / theirs (wall, then CPU seconds: user + system of the child and "
          "every process under it); cached: their cached tokens / ours", flush=True)


if __name__ == "__main__":
    main()
