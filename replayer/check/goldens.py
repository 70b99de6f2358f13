"""Goldens against a replay: the one check and the one update path, for every kind.

Each kind of golden (:data:`traces.goldens.outcomes.KINDS`: request outcomes, store
keys) is read, compared and rewritten the same way. :func:`check` compares a
replay with the goldens filed for its engine and says so in report lines;
:func:`update` (``--update-golden``, the only way goldens change) computes
every kind's new expectation first, then writes them all at once: a
scenario's ``expect:`` and ``expect_store:`` blocks in one atomic rewrite
(:mod:`traces.scenarios.golden_writer`), a trace directory's golden tables all
written before any is renamed into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayer.check.output import check_report
from replayer.replay.loop import ReplayResult
from traces import Trace
from traces.goldens.events import EVENTS, compare_events, from_rows
from traces.goldens.kind import ANY_ENGINE, GoldenKind, key_to_update, label, select
from traces.goldens.outcomes import REQUEST, compare
from traces.goldens.store import STORE, compare_store, from_report
from traces.model.errors import TraceError
from traces.trace import golden_path, write_tables
from traces.scenarios.compile import compile_scenario, is_scenario_path
from traces.scenarios.golden_writer import rewrite_blocks


def observed(kind: GoldenKind, result: ReplayResult) -> Any:
    """What a replay produced, in ``kind``'s terms (None: nothing of that kind)."""
    if kind is REQUEST:
        return result.requests
    if kind is EVENTS:
        return None if result.kv_events is None else from_rows(result.kv_events)
    if result.store is None:
        return None
    return from_report(result.store["rows"], result.store["lookups"])


def _check_store(trace: Trace, result: ReplayResult) -> tuple[list[str], bool]:
    got = observed(STORE, result)
    chosen = select(trace.store_goldens, result.engine.key)
    if got is None or chosen is None:
        return [], True
    key, expect = chosen
    diffs = compare_store(expect, got)
    if not diffs:
        puts, lookups = STORE.count(expect)
        fetched = (f", {STORE.keys(expect, 'gets')} key(s) fetched" if "gets" in expect
                   else "")
        return [f"  store: {puts} key(s) written{fetched} and {lookups} lookup(s) match the "
                f"store goldens for {label(key)}"], True
    lines = [f"  store: {len(diffs)} difference(s) against the store goldens for {label(key)}"]
    lines += [f"    {d.describe()}" for d in diffs]
    return lines, False


# Event differences listed in a report; the rest are counted.
MAX_EVENT_LINES = 12


def _check_events(trace: Trace, result: ReplayResult) -> tuple[list[str], bool]:
    chosen = select(trace.event_goldens, result.engine.key)
    if chosen is None:
        return [], True
    key, expect = chosen
    got = observed(EVENTS, result)
    if got is None:
        return [f"  kv events: the engine published no KV-cache events to check against the "
                f"event goldens for {label(key)}"], False
    diffs = compare_events(expect, got)
    if not diffs:
        stored, skipped, removed, cleared = EVENTS.count(expect)
        return [f"  kv events: {stored} stored, {skipped} skipped, {removed} removed block(s) "
                f"and {cleared} clear(s) match the event goldens for {label(key)}"], True
    lines = [f"  kv events: {len(diffs)} difference(s) against the event goldens for {label(key)}"]
    lines += [f"    {d.describe()}" for d in diffs[:MAX_EVENT_LINES]]
    if len(diffs) > MAX_EVENT_LINES:
        lines.append(f"    ... {len(diffs) - MAX_EVENT_LINES} more")
    return lines, False


def engine_key_of(spec: Any) -> str:
    """The key an engine's goldens are filed under (``vllm==X.Y.Z``), from a parsed
    spec (:func:`replayer.replay.engines.sources.specs.parse_spec`): known before it runs or is fetched."""
    from replayer.replay.engines import installed_vllm_version

    from traces.goldens.kind import engine_key

    version = installed_vllm_version() if spec.version is None else spec.version
    return engine_key(version)


def has_goldens(trace: Trace, key: str) -> bool:
    return select(trace.goldens, key) is not None


def said_before_replay(spec: Any, trace: Trace) -> bool:
    """Whether "no goldens" may be said of ``trace`` before any replay: not when the
    engine may refuse it anyway (connector replay on a release no store adapter
    serves, or on a tree whose release is not known yet, refused by
    :class:`replayer.replay.execution.child_process.EngineProcess`, which ``check`` reports as SKIP;
    or a setting the release lacks, see :func:`replayer.replay.engines.check_supported`)."""
    from replayer.replay.engines import UnsupportedByEngine, check_supported, installed_vllm_version

    version = installed_vllm_version() if spec.kind == "installed" else spec.version
    if version is None:
        return not trace.engine.connector
    try:
        check_supported(version, trace.engine, spec.text, spec.worker)
    except UnsupportedByEngine:
        return False
    return True


def no_goldens(path: Path | str, key: str) -> list[str]:
    """What ``check`` says, without replaying, of a target with no goldens for ``key``."""
    return [f"FAIL {path}: no goldens for engine {key} (record them with --update-golden); "
            "not replayed"]


def check(path: Path, trace: Trace, result: ReplayResult) -> tuple[list[str], bool]:
    """Report lines, and whether every kind of golden matched."""
    engine_key = result.engine.key
    chosen = select(trace.goldens, engine_key)
    if chosen is None:
        return [f"FAIL {path}: no goldens for engine {engine_key} "
                "(record them with --update-golden)"], False
    golden_key, expect = chosen
    mismatches = compare(expect, result.requests)
    store_lines, store_ok = _check_store(trace, result)
    event_lines, events_ok = _check_events(trace, result)
    head = check_report(str(path), engine_key, golden_key, mismatches, result, trace.engine,
                        len(expect), store_ok=store_ok, events_ok=events_ok)
    return [head, *store_lines, *event_lines], not mismatches and store_ok and events_ok


def _new_goldens(path: Path, trace: Trace, result: ReplayResult,
                 scenario: bool) -> dict[GoldenKind, tuple[str, Any]]:
    """kind -> (the engine key written, its new expectation), before anything is written.

    A scenario's entry is the one it was checked against (the engine's own, else
    the shared one, or the engine's own beside other engines' keyed entries);
    a trace directory files every kind under the engine's key."""
    engine_key = result.engine.key
    out: dict[GoldenKind, tuple[str, Any]] = {}
    key = key_to_update(trace.goldens, engine_key) if scenario else engine_key
    out[REQUEST] = (key, REQUEST.updated(trace.goldens.get(key), result.requests,
                                         whole=not scenario))
    got = observed(STORE, result)
    if got is not None:
        key = key_to_update(trace.store_goldens, engine_key) if scenario else engine_key
        out[STORE] = (key, got)
    got = observed(EVENTS, result)
    if got is not None:
        key = key_to_update(trace.event_goldens, engine_key) if scenario else engine_key
        out[EVENTS] = (key, EVENTS.updated(trace.event_goldens.get(key), got,
                                           whole=not scenario))
    return out


def _reads_back(path: Path, trace: Trace, new: dict[GoldenKind, tuple[str, Any]]):
    """A check for the rewritten scenario: it loads, and holds exactly the new goldens."""
    def check_file(tmp: Path) -> None:
        try:
            again = compile_scenario(tmp)
        except TraceError as exc:
            raise TraceError(path, f"the updated goldens would not read back ({exc.message}); "
                                   "nothing was written") from None
        for kind, (key, expect) in new.items():
            want = {**getattr(trace, kind.attr), key: expect}
            if getattr(again, kind.attr) != want:
                raise TraceError(path, f"the updated {kind.block} block does not read back as "
                                       "written; nothing was written")
    return check_file


def _golden_lock(path: Path):
    """A lock per golden file, outside the fixture tree (no stray ``.lock`` beside it).

    Two ``--update-golden`` runs on other engines of one scenario would each
    write back the blocks they read before their replay: the second erased the
    first's entry. Under this lock the file is read again before it is rewritten."""
    import hashlib
    import tempfile

    from filelock import FileLock
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return FileLock(Path(tempfile.gettempdir()) / f"prefix-replayer-goldens-{name}.lock")


def update(path: Path, trace: Trace, result: ReplayResult) -> list[str]:
    """Rewrite every kind of golden from this replay; the ``UPDATED`` lines to print.

    Under a lock on the file, the scenario's goldens are read again, so that
    another engine's entry written while this one replayed is kept."""
    path = Path(path)
    with _golden_lock(path):
        if is_scenario_path(path):
            trace = _with_goldens_on_disk(path, trace)
        return _update_locked(path, trace, result)


def _with_goldens_on_disk(path: Path, trace: Trace) -> Trace:
    """``trace`` with each kind's goldens as the file holds them now, over the ones it
    was read with (an entry the caller set up, as shrink's engine keys, is kept)."""
    import copy

    on_disk, fresh = compile_scenario(path), copy.copy(trace)
    for kind in (REQUEST, STORE, EVENTS):
        setattr(fresh, kind.attr, {**getattr(trace, kind.attr), **getattr(on_disk, kind.attr)})
    return fresh


def _update_locked(path: Path, trace: Trace, result: ReplayResult) -> list[str]:
    scenario = is_scenario_path(path)
    new = _new_goldens(path, trace, result, scenario)
    where: dict[GoldenKind, str] = {}
    if scenario:
        blocks = {}
        for kind, (key, expect) in new.items():
            goldens = {**getattr(trace, kind.attr), key: expect}
            depth = kind.levels + (0 if set(goldens) == {ANY_ENGINE} else 1)
            blocks[kind.block] = (kind.to_block(goldens), depth)
            where[kind] = f"{path} ({kind.block}:)"
        rewrite_blocks(path, blocks, check=_reads_back(path, trace, new))
    else:
        tables = {golden_path(path, kind, key): kind.to_table(expect, key)
                  for kind, (key, expect) in new.items()}
        for kind, target in zip(new, write_tables(tables)):
            where[kind] = str(target)
    lines = [f"UPDATED {path}: goldens for {label(new[REQUEST][0])} rewritten in "
             f"{where[REQUEST]} from engine {result.engine.key}; review the change before "
             "committing"]
    if STORE in new:
        lines.append(f"UPDATED {path}: store goldens rewritten in {where[STORE]}")
    if EVENTS in new:
        lines.append(f"UPDATED {path}: kv event goldens rewritten in {where[EVENTS]}")
    return lines
