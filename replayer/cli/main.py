"""The ``replayer`` command line: run, check, explain, sweep, report, diff, bisect,
compile, import, info.

Exit codes: 0 success, 1 a check failed (or goldens were just rewritten and
need review), 2 bad input or a replay that cannot go on (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from traces import TraceError, load_target

from replayer.replay.execution.environment import quiet_vllm

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
ENGINE_HELP = ("installed (default), vllm==X.Y.Z (a release, fetched once), or the path of a "
               "vLLM source tree")


def no_server_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--no-server", action="store_true",
                    help="replay cold in this command even while a warm server runs "
                         "(also PREFIX_REPLAYER_NO_SERVER=1)")


def force_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--force", action="store_true",
                    help="replace an existing trace at -o (never a recorded one; replaced "
                         "goldens are named on stderr)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayer", description=(
        "Replay recorded request streams through vLLM's own scheduler and KV-cache "
        "manager, and check prefix-cache hits against golden results."))
    p.add_argument("--version", action=_VersionAction, nargs=0,
                   help="the replayer's version, the installed vLLM and the releases it replays")
    sub = p.add_subparsers(dest="command", required=True)

    def engine_opts(sp: argparse.ArgumentParser, engine: bool = True) -> None:
        if engine:
            sp.add_argument("--engine", default="installed", metavar="SPEC", help=ENGINE_HELP)
        sp.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
        no_server_opt(sp)
        sp.add_argument("--no-progress", action="store_true", help="never show a progress bar")
        sp.add_argument("--no-shortcuts", action="store_true",
                        help="no speed shortcuts (reused prefix hashes): every request takes "
                             "vLLM's plain path; the output is the same, only slower")
        sp.add_argument("--store", default="memory", metavar="BACKEND",
                        help="store for a trace with a connector: memory (default), mooncake "
                             "(starts a mooncake_master on loopback) or mooncake://HOST:PORT")
        sp.add_argument("--store-capacity", metavar="SIZE",
                        help="store pool size, e.g. 64MB (memory: oldest keys evicted first; "
                             "mooncake: the master's segment)")

    def set_opt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--set", action="append", default=[], metavar="engine.KEY=VALUE",
                        help="replay under another geometry: change one engine key (YAML "
                             "value; null removes it; repeatable), validated as a scenario's")

    run = sub.add_parser("run", help="replay a scenario or trace and print its hits")
    run.add_argument("target", help="scenario .yaml or trace directory")
    run.add_argument("--json", metavar="OUT", help="write results as JSON ('-' for stdout)")
    run.add_argument("--store-ops", metavar="OUT.parquet",
                     help="write every store operation as a store_ops table (connector traces)")
    run.add_argument("--kv-events", metavar="OUT.parquet",
                     help="turn vLLM's KV-cache events on and write them as a kv_events table "
                          "(--json then holds their summary)")
    engine_opts(run)
    set_opt(run)

    check = sub.add_parser("check", help="replay targets and compare with their goldens")
    check.add_argument("targets", nargs="+", help="scenarios, trace directories, or folders of them")
    check.add_argument("--update-golden", action="store_true",
                       help="rewrite the goldens from this replay (still exits 1, for review)")
    check.add_argument("--against", choices=["goldens", "recorded"], default="goldens",
                       help="compare with the goldens (default), or with what a recorded trace "
                            "itself observed: outcomes, steps, store keys")
    engine_opts(check)
    set_opt(check)

    exp = sub.add_parser("explain", help="reachable vs actual hits per request, lost tokens "
                                         "by cause (counterfactual replays)")
    exp.add_argument("target", help="scenario .yaml or trace directory")
    exp.add_argument("--json", metavar="OUT", help="write requests and summary as JSON ('-' for stdout)")
    exp.add_argument("--parquet", metavar="OUT", help="write the per-request table as Parquet")
    exp.add_argument("--top", type=int, default=5, help="requests listed by lost tokens (5)")
    engine_opts(exp)
    set_opt(exp)

    sw = sub.add_parser("sweep", help="one explained replay per grid point, one table")
    sw.add_argument("target", help="scenario .yaml or trace directory")
    sw.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                    help="an engine key and its values (repeatable: the grid is the product)")
    sw.add_argument("--jobs", type=int, default=None,
                    help="local worker processes (default: the cores there are; 1: serial)")
    sw.add_argument("--ray", metavar="ADDRESS",
                    help="run the points on a Ray cluster ('auto', ray://HOST:PORT, or "
                         "'local' for a Ray instance started here; needs the ray extra)")
    sw.add_argument("--json", metavar="OUT", help="write the table as JSON, wall times left "
                                                  "out ('-' for stdout)")
    sw.add_argument("--parquet", metavar="OUT", help="write the table as Parquet")
    sw.add_argument("--engine", default="installed", metavar="SPEC", help=ENGINE_HELP)
    sw.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    no_server_opt(sw)
    set_opt(sw)

    rep = sub.add_parser("report", help="a self-contained HTML page: hit rate over time, "
                                        "reachable vs actual, lost by cause, per-group hits")
    rep.add_argument("target", help="scenario .yaml or trace directory")
    rep.add_argument("-o", "--output", required=True, metavar="OUT.html")
    rep.add_argument("--sweep", metavar="SWEEP.json",
                     help="also plot a sweep's hit rate against each swept key "
                          "(the --json of replayer sweep)")
    engine_opts(rep)
    set_opt(rep)

    diff = sub.add_parser("diff", help="replay a target on two engines; print what differs")
    diff.add_argument("target", help="scenario .yaml or trace directory")
    diff.add_argument("--engine", action="append", required=True, metavar="SPEC",
                      help="give it twice: engine A, then engine B (" + ENGINE_HELP + ")")
    diff.add_argument("--json", metavar="OUT", help="write the differences as JSON ('-' for stdout)")
    engine_opts(diff, engine=False)

    bis = sub.add_parser("bisect", help="find the first engine whose outcome differs from a good one")
    bis.add_argument("target", help="scenario .yaml or trace directory")
    bis.add_argument("--good", required=True, metavar="SPEC|COMMIT",
                     help="the reference: vllm==X.Y.Z, or a commit with --tree")
    bis.add_argument("--bad", required=True, metavar="SPEC|COMMIT",
                     help="an engine that differs: vllm==X.Y.Z, or a commit with --tree")
    bis.add_argument("--tree", metavar="PATH",
                     help="bisect over the commits of this vLLM git checkout")
    bis.add_argument("--on", choices=("any", "outcomes", "store"), default="any",
                     help="what must differ from good: any (default), outcomes (cached "
                          "tokens), store (keys written, lookups; connector traces)")
    engine_opts(bis, engine=False)

    shr = sub.add_parser("shrink", help="cut a trace down to a small scenario that keeps one "
                                        "property (a loss by cause, or two engines disagreeing)")
    shr.add_argument("target", help="scenario .yaml or trace directory")
    shr.add_argument("-o", "--output", required=True, metavar="SCENARIO.yaml")
    shr.add_argument("--request", metavar="ID", help="the request the property is about")
    shr.add_argument("--lost-by", metavar="CAUSE", help="keep: --request loses tokens to this "
                                                        "cause (replayer explain's causes)")
    shr.add_argument("--at-least", type=int, metavar="N",
                     help="with --lost-by: at least N tokens (default: as many as the input)")
    shr.add_argument("--engine", metavar="SPEC", help="with --lost-by: " + ENGINE_HELP)
    shr.add_argument("--diff", nargs=2, metavar=("ENGINE_A", "ENGINE_B"),
                     help="keep: the two engines disagree (on --request, if given)")
    shr.add_argument("--on", choices=("outcomes", "store"), default="outcomes",
                     help="with --diff: disagree on hits (default) or on store keys/lookups")
    shr.add_argument("--max-probes", type=int, metavar="N", help="stop after N probes")
    shr.add_argument("--timeout", type=float, metavar="SECONDS", help="stop after this long")
    shr.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    no_server_opt(shr)

    comp = sub.add_parser("compile", help="compile a scenario into a trace directory")
    comp.add_argument("scenario")
    comp.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(comp)

    imp = sub.add_parser("import", help="import a public trace format")
    imp.add_argument("format", choices=["mooncake"])
    imp.add_argument("file")
    imp.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(imp)
    imp.add_argument("--limit", type=int, help="only the first N requests")
    imp.add_argument("--engine", metavar="ENGINE.yaml", help="YAML file with an engine: block")
    imp.add_argument("--step-ms", type=int, default=None,
                     help="milliseconds of production time per engine step (default 20)")

    srv = sub.add_parser("server", help="a warm engine server: vLLM imported once, every "
                                        "replay a fresh fork of it (start, status, stop)")
    srv.add_argument("action", choices=["start", "status", "stop"])
    srv.add_argument("--engine", action="append", metavar="SPEC",
                     help="start: warm this engine now (repeatable; default installed; "
                          "others start on their first replay)")
    srv.add_argument("--lazy", action="store_true",
                     help="start: warm no engine now (each starts on its first replay)")
    srv.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                     help="start: stop by itself after this long unused (default 4 h)")
    srv.add_argument("--replay-timeout", type=float, default=None, metavar="SECONDS",
                     help="start: kill a replay that runs longer, and report it (default: none)")
    srv.add_argument("--replay-memory", type=int, default=None, metavar="MB",
                     help="start: kill a replay that holds more memory of its own, and "
                          "report it (default: none)")

    info = sub.add_parser("info", help="print a trace's header and table sizes")
    info.add_argument("target")

    anon = sub.add_parser("anonymize", help="replace token ids by block-hash-derived tokens")
    anon.add_argument("target", help="trace directory (or scenario)")
    anon.add_argument("-o", "--output", required=True, help="trace directory to write")
    force_opt(anon)
    anon.add_argument("--unit", type=int, help="tokens per hashed chunk (default: the largest "
                                               "that divides every block size, the PMU and the "
                                               "lookahead offset of EAGLE's block hashes)")
    anon.add_argument("--secret", metavar="HEX",
                      help="hash key, for reproducible ids (default: random, never stored)")
    return p


def _version_text() -> str:
    """Package metadata only: no vLLM import, so ``--version`` answers at once."""
    from importlib import metadata

    from replayer.replay.engines import EngineError, installed_vllm_version, supported_ranges

    try:
        own = metadata.version("prefix-replayer")
    except metadata.PackageNotFoundError:
        own = "(not installed)"
    try:
        vllm = f"vLLM {installed_vllm_version()} installed"
    except EngineError:
        vllm = "no vLLM installed"
    return f"replayer {own}\n{vllm}; replays vLLM releases {supported_ranges()}"


class _VersionAction(argparse.Action):
    """``--version``, printed as is (argparse's own action rewraps the lines)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version_text())
        parser.exit()


def _err(msg: str) -> int:
    msg = " ".join(part.strip() for part in msg.splitlines() if part.strip())  # always one line
    print(f"replayer: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


_NOTES_SAID: set[str] = set()


def _store_spec(args):
    """``--store`` and ``--store-capacity`` as a StoreSpec; bad ones name the option."""
    from replayer.replay.store import StoreError, parse_store_spec

    try:
        return parse_store_spec(args.store, args.store_capacity)
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def _replay(target, args, run, **sink):
    """Replay ``target`` on ``run`` (from :func:`replayer.replay.execution.clients.engine_runner`);
    says each engine note once on stderr. ``sink=``: outcomes streamed there
    (a runner in this process)."""
    from replayer.replay.engines import EngineError
    from replayer.replay.engines.config_errors import BUILD_FAILED
    from replayer.cli.progress import ProgressBar

    store = _ready_store(target, args)
    bar = ProgressBar(enabled=None if not args.no_progress else False)
    try:
        # Only said when off, so runners that predate the option keep working.
        extra = {"shortcuts": False} if getattr(args, "no_shortcuts", False) else {}
        result = run(target, progress=bar, store=store, **extra, **sink)
    except EngineError as exc:
        if BUILD_FAILED in str(exc) and target.path is not None:   # name the file it came from
            raise TraceError(target.path, str(exc)) from None
        raise
    finally:
        bar.close()
    _say_notes(result)
    return result


def _ready_store(target, args):
    """The store spec, its master reachable first where the trace uses one."""
    store = _store_spec(args)
    if store.host is not None and target.engine.connector:
        from replayer.replay.store.master import wait_reachable

        wait_reachable(store.host, store.port)      # seconds, before vLLM is even imported
    return store


def _explain(trace, args, run):
    """explain's replays: all at once on the warm server, else one after the other."""
    from replayer.analysis.explain import explain

    many = None
    if getattr(run, "parallel", False):
        def many(traces):
            results = run.replay_many(traces, store=_ready_store(trace, args))
            for result in results:
                _say_notes(result)
            return results
    return explain(trace, run=lambda t: _replay(t, args, run), run_many=many)


def _say_notes(result) -> None:
    for note in result.notes:
        if note not in _NOTES_SAID:
            _NOTES_SAID.add(note)
            print(f"replayer: note: {note}", file=sys.stderr)


def cmd_run(args) -> int:
    from replayer.replay.engines.specs import parse_spec
    from traces.io.atomic import write_atomic

    from replayer.replay.execution.clients import engine_runner, runs_in_this_process
    from replayer.check.output import SpooledJson, dumps, run_table

    spec = parse_spec(args.engine)          # a bad spec is reported before anything runs
    _check_outputs(args)                    # and an output that cannot be written
    here = runs_in_this_process(spec)
    # Replayed in this process: its prompts are read batch by batch.
    trace = _load_with_sets(args.target, args.set, stream=here)
    _note_skipped(trace)
    if args.store_ops and not trace.engine.connector:
        raise TraceError(args.target, "--store-ops needs a trace with engine.connector")
    _check_store_applies(args, [trace])
    if args.kv_events:
        trace.kv_events_wanted = True
    # --json FILE in this process: outcomes spooled as they complete, never all held.
    spool = SpooledJson() if args.json and args.json != "-" and here else None
    with engine_runner(spec) as run:
        result = _replay(trace, args, run, **({} if spool is None else {"sink": spool}))
    print(run_table(result, shown_of=spool), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.store_ops:
        from traces.model.trace import write_table_atomic
        from traces.model import schema
        write_table_atomic(args.store_ops, schema.STORE_OPS, result.store["rows"])
    if args.kv_events:
        from traces.model.trace import write_table_atomic
        from traces.model import schema
        write_table_atomic(args.kv_events, schema.KV_EVENTS, result.kv_events or [])
    if args.json == "-":
        sys.stdout.write(dumps(result))
    elif spool is not None:
        write_atomic(args.json, lambda tmp: spool.write(tmp, result))
        spool.close()
    elif args.json:
        write_atomic(args.json, dumps(result))
    return EXIT_OK


def _check_outputs(args) -> None:
    """``--json`` and ``--store-ops`` files that cannot be written fail before the replay."""
    from traces.io.atomic_dir import check_output_file

    if getattr(args, "json", None) and args.json != "-":
        check_output_file(args.json, "--json")
    if getattr(args, "store_ops", None):
        check_output_file(args.store_ops, "--store-ops")
    if getattr(args, "kv_events", None):
        check_output_file(args.kv_events, "--kv-events")


def _check_store_applies(args, traces) -> None:
    """``--store``/``--store-capacity`` only mean something for a trace with a connector."""
    if args.store == "memory" and args.store_capacity is None:
        return
    _store_spec(args)                       # a bad value is named first
    if not any(t.engine.connector for t in traces):
        what = "--store " + args.store if args.store != "memory" else "--store-capacity"
        where = traces[0].path if len(traces) == 1 else "the targets"
        raise TraceError(where, f"{what} applies to a trace with engine.connector, and "
                                f"{'it has' if len(traces) == 1 else 'none has'} none")


def _expand_targets(targets: Sequence[str]) -> list[Path]:
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


def cmd_check(args) -> int:
    from replayer.replay.engines import UnsupportedByEngine
    from replayer.replay.engines.specs import parse_spec
    from replayer.replay.execution.clients import engine_runner

    spec = parse_spec(args.engine)
    paths = _expand_targets(args.targets)
    # All bad input is reported before any replay.
    traces = [(p, _load_with_sets(p, args.set)) for p in paths]
    if args.set and args.update_golden:
        raise TraceError("--set", "goldens belong to the trace's own geometry "
                                  "(drop --update-golden)")
    _check_store_applies(args, [t for _, t in traces])
    for _, trace in traces:
        _note_skipped(trace)
    if args.against == "recorded":
        return _check_recorded(args, traces, spec)
    worst = EXIT_OK
    if not args.update_golden:                      # said before any replay, and not replayed
        from replayer.check.goldens import engine_key_of, has_goldens, no_goldens, said_before_replay

        key = engine_key_of(spec)
        unchecked = [(p, t) for p, t in traces
                     if said_before_replay(spec, t) and not has_goldens(t, key)]
        for path, _ in unchecked:
            print("\n".join(no_goldens(path, key)), flush=True)
            worst = EXIT_MISMATCH
        traces = [(p, t) for p, t in traces if all(p is not q for q, _ in unchecked)]
        if not traces:
            return worst
    with engine_runner(spec) as run:                # one engine process for every target
        for path, trace in traces:
            try:
                result = _replay(trace, args, run)
            except UnsupportedByEngine as exc:
                print(f"SKIP {path}: {exc}")
                continue
            worst = max(worst, _check_one(args, path, trace, result))
    return worst


def _load_with_sets(path, sets, stream=False):
    """A target, replayed under ``--set`` changes when there are any; ``stream``:
    its prompts left in the file for the replay to read in batches."""
    from traces.scenarios.what_if import with_sets

    return with_sets(load_target(path, stream=stream), sets)


def cmd_explain(args) -> int:
    from replayer.replay.engines.specs import parse_spec
    from replayer.analysis.explain import explain
    from replayer.analysis.explain_tables import render, write_parquet_atomic
    from traces.io.atomic import write_atomic
    from replayer.replay.execution.clients import engine_runner

    spec = parse_spec(args.engine)
    if args.top < 0:
        return _err("--top must be at least 0")
    trace = _load_with_sets(args.target, args.set)
    _note_skipped(trace)
    _store_spec(args)                        # a bad --store is reported before any replay
    with engine_runner(spec) as run:         # one engine process for every counterfactual
        ex = _explain(trace, args, run)
    print(render(ex, top=args.top))
    if args.parquet:
        write_parquet_atomic(args.parquet, ex.table)
    if args.json == "-":
        sys.stdout.write(ex.dumps())
    elif args.json:
        write_atomic(args.json, ex.dumps())
    return EXIT_OK


def cmd_sweep(args) -> int:
    from replayer.replay.engines.specs import parse_spec
    from replayer.analysis.explain_tables import write_parquet_atomic
    from traces.io.atomic import write_atomic
    from replayer.analysis.sweep import comparable, parse_grid, run_sweep, table_text

    parse_spec(args.engine)
    if args.jobs is not None and args.jobs < 1:
        return _err("--jobs must be at least 1")
    keys, points = parse_grid(args.grid)
    trace = _load_with_sets(args.target, args.set)     # bad input before any worker starts
    for p in points:
        from traces.scenarios.what_if import apply_sets

        apply_sets(trace.engine, p)
    if args.ray:
        executor, address = "ray", (None if args.ray == "local" else args.ray)
    else:
        executor, address = ("serial" if args.jobs == 1 else "pool"), None
    rows = run_sweep(args.target, points, engine_spec=args.engine, executor=executor,
                     workers=args.jobs, ray_address=address, base=args.set)
    print(table_text(keys, rows))
    where = f"Ray ({args.ray})" if args.ray else (
        "serially" if executor == "serial" else "on a local process pool")
    print(f"\n{len(points)} point(s) of {args.target} run {where}")
    text = json.dumps({"grid": keys, "base": args.set, "rows": comparable(rows)},
                      indent=2) + "\n"
    if args.parquet:
        import polars as pl

        write_parquet_atomic(args.parquet, pl.DataFrame(rows))
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        write_atomic(args.json, text)
    return EXIT_OK


def cmd_report(args) -> int:
    from replayer.replay.engines.specs import parse_spec
    from replayer.analysis.explain import explain
    from replayer.analysis.html_report import render_html
    from traces.io.atomic import write_atomic
    from replayer.replay.execution.clients import engine_runner

    spec = parse_spec(args.engine)
    sweep = None
    if args.sweep:
        try:
            sweep = json.loads(Path(args.sweep).read_text())
        except OSError as exc:
            raise TraceError(args.sweep, f"cannot read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise TraceError(args.sweep, f"invalid JSON: {exc.msg}") from None
        if not isinstance(sweep, dict) or not isinstance(sweep.get("grid"), list) \
                or not isinstance(sweep.get("rows"), list):
            raise TraceError(args.sweep, "not the --json of replayer sweep (grid, rows)")
    trace = _load_with_sets(args.target, args.set)
    _note_skipped(trace)
    _store_spec(args)
    with engine_runner(spec) as run:
        ex = _explain(trace, args, run)
    write_atomic(args.output, render_html(ex, str(args.target), trace.header, sweep))
    s = ex.summary()
    print(f"wrote {args.output}: {s['requests']} requests, hit rate {s['hit_rate']:.1%} of "
          f"reachable {s['reachable_rate']:.1%}" + (f", sweep of {len(sweep['rows'])} point(s)"
                                                    if sweep else ""))
    return EXIT_OK


def _note_skipped(trace) -> None:
    for part in trace.skipped_parts:
        print(f"replayer: note: skipped half-written part {part}", file=sys.stderr)
    for note in trace.notes:
        print(f"replayer: note: {note}", file=sys.stderr)


def _check_recorded(args, traces, spec) -> int:
    """``check --against recorded``: each replay against its own recording, on the
    installed vLLM or a release the recorder hooks (``--engine vllm==0.32.0``)."""
    from replayer.replay.engines import UnsupportedByEngine
    from replayer.check.recorded import check_against_recorded

    if args.update_golden:
        raise TraceError("--against recorded", "recorded observations are never rewritten "
                                               "(drop --update-golden)")
    store = _store_spec(args)
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


def _check_one(args, path: Path, trace, result) -> int:
    """Compare one replay with its goldens (or rewrite them); the exit code it earns."""
    from replayer.check import goldens as golden_check
    if args.update_golden:
        print("\n".join(golden_check.update(path, trace, result)))
        return EXIT_MISMATCH                        # a rewrite is always reviewed
    lines, ok = golden_check.check(path, trace, result)
    print("\n".join(lines))
    return EXIT_OK if ok else EXIT_MISMATCH


def cmd_diff(args) -> int:
    from replayer.compare.outcomes import compare_results, diff_table
    from replayer.replay.engines.specs import parse_spec
    from traces.io.atomic import write_atomic
    from replayer.replay.execution.clients import engine_runner

    if len(args.engine) != 2:
        return _err(f"diff takes exactly two --engine options (A, then B), got {len(args.engine)}")
    specs = [parse_spec(e) for e in args.engine]
    _check_outputs(args)
    trace = load_target(args.target)
    _check_store_applies(args, [trace])
    results = []
    for spec in specs:
        with engine_runner(spec) as run:
            results.append(_replay(trace, args, run))
    d = compare_results(*results)
    print(diff_table(d), file=sys.stderr if args.json == "-" else sys.stdout)
    text = json.dumps(d.as_dict(), indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        write_atomic(args.json, text)
    return EXIT_OK if d.identical else EXIT_MISMATCH


def cmd_bisect(args) -> int:
    """Prints the header first and each replay as it ends (each takes 10-35 s)."""
    from replayer.compare.bisection import CommitLine, conclusion, header_line, probe_line, release_line, search
    from replayer.replay.execution.clients import engine_runner

    def say(text: str) -> None:
        print(text, flush=True)

    trace = load_target(args.target)
    _check_store_applies(args, [trace])
    if args.on == "store" and not trace.engine.connector:
        return _err(f"{args.target}: bisect --on store needs a trace with a connector "
                    "(engine.connector)")

    def replay_on(spec):
        with engine_runner(spec) as run:        # each engine's process ends with its replay
            return _replay(trace, args, run)

    if args.tree is None:
        line = release_line(args.good, args.bad)
        say(header_line(len(line), "releases"))
        res = search(line, replay_on, on_probe=lambda p: say(probe_line(p)), on=args.on)
    else:
        commits = CommitLine(args.tree, args.good, args.bad)
        try:
            say(header_line(len(commits.commits), f"commits of {commits.tree}"))
            res = search(commits.commits, lambda c: replay_on(commits.engine(c)),
                         on_probe=lambda p: say(probe_line(p)), on=args.on)
        finally:
            commits.close()
    say(conclusion(res))
    return EXIT_OK if res.first_bad is not None else EXIT_MISMATCH


def cmd_shrink(args) -> int:
    from replayer.analysis.shrink.cli import run_shrink

    return run_shrink(args, _err)


def _plan_output(args, inputs) -> list[str]:
    """Refuse a bad ``-o`` before reading anything; the notes to say once written
    (what ``--force`` replaced, temporaries of killed runs removed)."""
    from traces.io.atomic_dir import clean_stale, output_dir_plan

    notes = output_dir_plan(args.output, args.force, inputs)
    return notes + clean_stale(Path(args.output).absolute())


def _say(notes: list[str]) -> None:
    for note in notes:
        print(f"replayer: note: {note}", file=sys.stderr)


def cmd_compile(args) -> int:
    from traces.scenarios.compile import compile_scenario
    from traces.model.trace import write_trace

    notes = _plan_output(args, [args.scenario])
    trace = compile_scenario(args.scenario)
    out = write_trace(trace, args.output, force=args.force, inputs=(args.scenario,))
    _say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests)")
    return EXIT_OK


def _engine_yaml(path: str):
    from traces.model.engine_spec import EngineBlock
    from traces.scenarios.compile import load_yaml

    p = Path(path)
    data = load_yaml(p)
    for key in data:
        if key != "engine":
            raise TraceError(p, f"unknown key {key!r} (an engine file holds only 'engine:')")
    if "engine" not in data:
        raise TraceError(p, "no 'engine:' block")
    from traces.model.sanity import check_async_scheduling

    engine = EngineBlock.from_dict(str(p), data["engine"])
    check_async_scheduling(p, engine, "imported")
    return engine


def cmd_import(args) -> int:
    from traces.io.importers.mooncake import import_mooncake
    from traces.model.step_clock import DEFAULT_STEP_MS
    from traces.model.trace import write_trace

    if args.limit is not None and args.limit < 1:
        return _err("--limit must be at least 1")
    step_ms = DEFAULT_STEP_MS if args.step_ms is None else args.step_ms
    if step_ms < 1:
        return _err("--step-ms must be at least 1")
    notes = _plan_output(args, [args.file])
    engine = _engine_yaml(args.engine) if args.engine else None
    trace = import_mooncake(args.file, limit=args.limit, engine=engine, step_ms=step_ms)
    out = write_trace(trace, args.output, force=args.force, inputs=(args.file,))
    _say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests)")
    return EXIT_OK


def cmd_info(args) -> int:
    from traces.model import schema
    from traces.goldens.kind import label
    from traces.goldens.store import STORE
    from traces.io.parts import parts_on_disk

    trace = load_target(args.target)
    print(trace.header_json(), end="")
    for name in schema.TABLES:
        table = trace.table(name)
        if table is None:
            continue
        size = ""
        if trace.path is not None and trace.path.is_dir():
            f = trace.path / schema.TABLES[name].file
            if f.exists():
                size = f", {f.stat().st_size} bytes on disk"
            else:                                   # a recorded table: a folder of parts
                nbytes, parts = parts_on_disk(trace.path / name)
                size = f", {nbytes} bytes on disk in {parts} part(s)"
        print(f"{name}: {table.num_rows} rows, {table.num_columns} columns{size}")
    rq = trace.requests
    print(f"prompt tokens: {sum(rq['num_prompt_tokens'].to_pylist())}")
    for part in trace.skipped_parts:
        print(f"skipped half-written part: {part}")
    for note in trace.notes:
        print(f"note: {note}")
    for key, expect in sorted(trace.goldens.items()):
        print(f"goldens for {label(key)}: {len(expect)} requests")
    for key, expect in sorted(trace.store_goldens.items()):
        puts, lookups = STORE.count(expect)
        print(f"store goldens for {label(key)}: {puts} keys, {lookups} lookups")
    from traces.goldens.events import EVENTS

    for key, expect in sorted(trace.event_goldens.items()):
        stored, skipped, removed, cleared = EVENTS.count(expect)
        print(f"kv event goldens for {label(key)}: {stored} stored, {skipped} skipped, "
              f"{removed} removed, {cleared} cleared")
    return EXIT_OK


def cmd_anonymize(args) -> int:
    from traces.model.trace import write_trace

    from replayer.analysis.anonymize import anonymize, default_unit

    if args.unit is not None and args.unit < 1:
        return _err("--unit must be at least 1")
    secret = None
    if args.secret is not None:
        try:
            secret = bytes.fromhex(args.secret)
        except ValueError:
            return _err(f"--secret must be hexadecimal, got {args.secret!r}")
        if not 1 <= len(secret) <= 64:
            return _err("--secret must be 1 to 64 bytes")
    notes = _plan_output(args, [args.target])
    trace = load_target(args.target)
    _note_skipped(trace)
    unit = args.unit or default_unit(trace.engine)
    out = write_trace(anonymize(trace, unit=unit, secret=secret), args.output, force=args.force,
                      inputs=(args.target,))
    _say(notes)
    print(f"wrote {out} ({trace.requests.num_rows} requests; tokens replaced by ids of "
          f"{unit}-token chunks)")
    return EXIT_OK


def cmd_server(args) -> int:
    from replayer.replay.execution.warm import control

    if args.action != "start" and (args.engine or args.idle_timeout is not None or args.lazy
                                   or args.replay_timeout or args.replay_memory):
        return _err(f"server {args.action} takes no options")
    if args.action == "start":
        from replayer.replay.execution.warm.server import DEFAULT_IDLE_TIMEOUT_S

        idle = DEFAULT_IDLE_TIMEOUT_S if args.idle_timeout is None else args.idle_timeout
        if idle <= 0 or (args.replay_timeout is not None and args.replay_timeout <= 0) \
                or (args.replay_memory is not None and args.replay_memory <= 0):
            return _err("--idle-timeout, --replay-timeout and --replay-memory must be positive")
        if args.lazy and args.engine:
            return _err("server start: --lazy warms no engine; drop --engine")
        engines = [] if args.lazy else (args.engine or ["installed"])
        lines, code = control.start(engines, idle, args.replay_timeout,
                                    args.replay_memory)
    elif args.action == "status":
        lines, code = control.status()
    else:
        lines, code = control.stop()
    for line in lines:
        print(line, file=sys.stderr if line.startswith("replayer: error") else sys.stdout)
    return code


COMMANDS = {"run": cmd_run, "check": cmd_check, "explain": cmd_explain, "sweep": cmd_sweep,
            "report": cmd_report,
            "diff": cmd_diff, "bisect": cmd_bisect, "shrink": cmd_shrink,
            "compile": cmd_compile, "import": cmd_import, "info": cmd_info,
            "anonymize": cmd_anonymize, "server": cmd_server}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(args_list)
    from replayer.cli import REPLAY_COMMANDS

    if args.command in REPLAY_COMMANDS and argv is None:
        from replayer.replay.execution.determinism import reexec_with_pinned_seed

        reexec_with_pinned_seed(args_list)
    quiet_vllm(getattr(args, "verbose", False))
    if getattr(args, "no_server", False):
        from replayer.replay.execution.warm.paths import NO_SERVER_ENV

        os.environ[NO_SERVER_ENV] = "1"
    from replayer.replay.engines import EngineError
    from replayer.replay.loop import ReplayError
    from replayer.replay.store import StoreError

    try:
        return COMMANDS[args.command](args)
    except (TraceError, EngineError, ReplayError, StoreError) as exc:
        return _err(str(exc))
    except OSError as exc:                  # a disk that is full, read-only, gone
        where = exc.filename or "replayer"
        return _err(f"{where}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())
