"""`replayer check`: replay targets and compare with their goldens, or with what a
recording observed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from replayer.cli.common import (
    EXIT_MISMATCH,
    EXIT_OK,
    check_outputs,
    check_store_applies,
    engine_opts,
    load_with_sets,
    note_skipped,
    replay_target,
    set_opt,
    store_spec,
    write_output,
)
from traces import TraceError


def add_parser(sub) -> None:
    check = sub.add_parser("check", help="replay targets and compare with their goldens")
    check.add_argument("targets", nargs="+",
                       help="scenarios, trace directories, or folders of them")
    check.add_argument("--update-golden", action="store_true",
                       help="rewrite the goldens from this replay (still exits 1, for review)")
    check.add_argument("--against", choices=["goldens", "recorded"], default="goldens",
                       help="compare with the goldens (default), or with what a recorded trace "
                            "itself observed: outcomes, steps, store keys")
    check.add_argument("--recompute", action="store_true",
                       help="with --worker model: replay every request that had a hit again, "
                            "cold, and name each hit whose logprobs differ from its recompute "
                            "by more than the calibrated tolerance (a wrong hit: exit 1)")
    check.add_argument("--recompute-topk", type=int, default=None, metavar="K",
                       help="with --recompute: compare the K most likely tokens' logprobs at "
                            "every prompt position after a hit and every output token "
                            "(default 20; -1: the whole vocabulary, costly on long prompts)")
    check.add_argument("--recompute-only", action="store_true",
                       help="with --recompute: the verdict is the recompute's alone, the "
                            "hit counts are not held to goldens (as where there are none)")
    check.add_argument("--json", metavar="OUT",
                       help="with --recompute: write each target's per-hit verdicts as JSON "
                            "('-' for stdout)")
    engine_opts(check)
    set_opt(check)


def run(args) -> int:
    from replayer.replay.engines.sources.specs import parse_spec, resolve_unless_known

    check_recompute_options(args)
    spec = parse_spec(args.engine, args.worker)
    check_outputs(args)
    paths = expand_targets(args.targets)
    # All bad input is reported before any replay.
    traces = [(p, load_with_sets(p, args.set, allow_missing=args.allow_missing)) for p in paths]
    if args.set and args.update_golden:
        raise TraceError("--set", "goldens belong to the trace's own geometry "
                                  "(drop --update-golden)")
    check_store_applies(args, [t for _, t in traces])
    for _, trace in traces:
        note_skipped(trace)
    if args.against == "recorded":
        return check_recorded(args, traces, spec)
    # A release not known to exist is fetched before its goldens are looked for:
    # one that does not exist is bad input (exit 2), not "no goldens".
    engine = resolve_unless_known(spec)
    worst, traces = EXIT_OK, list(traces)
    if not args.update_golden and not args.recompute:   # said before any replay, not replayed
        worst, traces = said_without_goldens(spec, traces)
        if not traces:
            return worst
    reports: dict[str, Any] = {}
    worst = max(worst, check_each(args, engine, traces, reports))
    if args.json:
        import json

        write_output(args.json, json.dumps(reports, indent=2) + "\n")
    return worst


def check_recompute_options(args) -> None:
    """The recompute's options, refused together with what they cannot go with."""
    if (args.recompute_topk is not None or args.recompute_only) and not args.recompute:
        opt = "--recompute-only" if args.recompute_only else "--recompute-topk"
        raise TraceError(opt, "goes with --recompute")
    if args.recompute_topk is not None and args.recompute_topk < 1 and args.recompute_topk != -1:
        raise TraceError("--recompute-topk", f"{args.recompute_topk}: give K of 1 or more, or -1 "
                                             "for the whole vocabulary")
    if args.recompute and args.worker != "model":
        raise TraceError("--recompute", "needs the model worker (--worker model): the null "
                                        "executor computes no logprobs to compare")
    if args.json and not args.recompute:
        raise TraceError("--json", "check writes JSON with --recompute only")
    if args.recompute and (args.update_golden or args.against == "recorded"):
        raise TraceError("--recompute", "checks hits against their recompute; it takes neither "
                                        "--update-golden nor --against recorded")


def said_without_goldens(spec, traces: list) -> tuple[int, list]:
    """Targets with no goldens for ``spec`` said (exit 1) before any replay, and
    the targets left to replay."""
    from replayer.check.goldens import engine_key_of, has_goldens, no_goldens, said_before_replay

    key = engine_key_of(spec)
    unchecked = [(p, t) for p, t in traces
                 if said_before_replay(spec, t) and not has_goldens(t, key)]
    for path, _ in unchecked:
        print("\n".join(no_goldens(path, key)), flush=True)
    left = [(p, t) for p, t in traces if all(p is not q for q, _ in unchecked)]
    return (EXIT_MISMATCH if unchecked else EXIT_OK), left


def check_each(args, engine, traces: list, reports: dict[str, Any]) -> int:
    """Every target replayed on one engine process and checked: its hit counts
    against its goldens, and with --recompute (or ``expect_recompute`` on the
    model worker) every hit against its recompute, whose report lands in ``reports``."""
    from replayer.replay.engines import UnsupportedByEngine
    from argparse import Namespace
    from contextlib import ExitStack

    from replayer.replay.execution.clients import beside, engine_runner, references_side_by_side

    worst = EXIT_OK
    with engine_runner(engine) as run, ExitStack() as stack:   # one engine process for all
        side = None
        if references_side_by_side() and any(
                args.recompute or (t.expect_recompute and args.worker == "model")
                for _, t in traces):        # the looser reference's, side by side (reference.py)
            side_run = stack.enter_context(beside(run))
            quiet = Namespace(**{**vars(args), "no_progress": True})   # one bar on stderr
            side = lambda t, **kw: replay_target(t, quiet, side_run, **kw)  # noqa: E731
        for path, trace in traces:
            recompute = args.recompute or (trace.expect_recompute and args.worker == "model")
            replay = lambda t, **kw: replay_target(t, args, run, **kw)  # noqa: E731
            try:
                if recompute:        # at one thread, its schedule logged (check.recompute)
                    from replayer.check.recompute import hit_replay

                    result, log = hit_replay(trace, replay, topk(args))
                else:
                    result = replay(trace)
            except UnsupportedByEngine as exc:
                print(f"SKIP {path}: {exc}")
                continue
            worst = max(worst, check_hit_counts(args, path, trace, result))
            if trace.expect_recompute and not args.recompute and args.worker == "null":
                print(f"note: {path} expects every hit to match its recompute "
                      "(expect_recompute): checked with --worker model only")
            if recompute:
                from replayer.check.recompute import recompute_check, report_lines

                report = recompute_check(trace, result, replay, log, topk(args), side)
                print("\n".join(report_lines(path, report)), flush=True)
                reports[str(path)] = report.as_dict()
                if report.wrong:
                    worst = max(worst, EXIT_MISMATCH)
    return worst


def expand_targets(targets: Sequence[str]) -> list[Path]:
    """Folders that are not traces expand to the scenarios and traces inside."""
    out: list[Path] = []
    for t in targets:
        p = Path(t)
        if p.is_dir() and not (p / "header.json").exists():
            found = sorted(q for q in p.rglob("*") if (q.suffix in (".yaml", ".yml")
                           or (q.is_dir() and (q / "header.json").exists()))
                           # dot-names: temporaries of a killed import, hidden folders
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            if not found:
                raise TraceError(p, "holds no scenario (.yaml) or trace directory")
            out.extend(found)
        else:
            out.append(p)
    return out



def check_recorded(args, traces, spec) -> int:
    """``check --against recorded``: each replay against its own recording, on the
    installed vLLM or a release the recorder hooks (``--engine vllm==0.32.0``)."""
    from replayer.check.recorded import check_against_recorded
    from replayer.replay.engines import UnsupportedByEngine

    if args.update_golden:
        raise TraceError("--against recorded", "recorded observations are never rewritten "
                                               "(drop --update-golden)")
    store = store_spec(args)
    worst = EXIT_OK
    for path, trace in traces:
        try:
            lines, ok, _ = check_against_recorded(trace, store=store, spec=spec)
        except UnsupportedByEngine as exc:
            print(f"SKIP {path}: {exc}")
            continue
        print(f"{'PASS' if ok else 'FAIL'} {path}: {lines[0]}")
        for line in lines[1:]:
            print(line)
        worst = max(worst, EXIT_OK if ok else EXIT_MISMATCH)
    return worst



def topk(args) -> int:
    """How many most likely tokens the recompute compares (``--recompute-topk``)."""
    from replayer.check.recompute import TOPK

    return TOPK if getattr(args, "recompute_topk", None) is None else args.recompute_topk


def check_hit_counts(args, path: Path, trace, result) -> int:
    """The goldens' verdict, except under ``--recompute`` where there are none for
    this engine (or ``--recompute-only``): then one line says that the verdict is
    the recompute's alone."""
    if args.recompute and not args.update_golden:
        from replayer.check.goldens import has_goldens

        key = result.engine.key
        if args.recompute_only or not has_goldens(trace, key):
            why = "--recompute-only" if args.recompute_only else f"no goldens for engine {key}"
            print(f"note: {path}: {why}: hit counts not checked, the verdict is the "
                  "recompute's alone", flush=True)
            return EXIT_OK
    return check_one(args, path, trace, result)


def check_one(args, path: Path, trace, result) -> int:
    """Compare one replay with its goldens (or rewrite them); the exit code it earns."""
    from replayer.check import goldens as golden_check
    if args.update_golden:
        print("\n".join(golden_check.update(path, trace, result)))
        return EXIT_MISMATCH                        # a rewrite is always reviewed
    lines, ok = golden_check.check(path, trace, result)
    print("\n".join(lines))
    return EXIT_OK if ok else EXIT_MISMATCH

