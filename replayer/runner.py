"""Where an engine runs: the one place that opens one, here or in a child process.

The installed vLLM is built in this process; a release or a source tree runs
in a child process of its own (:mod:`replayer.engine_process`), which builds
it with the same :func:`replay_here`. Every caller (the CLI's run, check,
diff and bisect, ``check --against recorded``, the recorder's round trip)
goes through :func:`engine_runner` or :func:`replay_on`, so an engine is
opened, seeded, replayed and closed one way; benchmarks that drive an engine
by hand get it from :func:`engine_here`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

from traces import Trace

from .determinism import engine_hash_seed
from .engines import EngineAdapter, open_engine
from .engines.specs import INSTALLED, EngineSpec, ResolvedEngine, resolve
from .gc_tuning import fewer_gc_passes
from .replay import Progress, ReplayResult, refuse_unsupported, replay

Runner = Callable[..., ReplayResult]
Spec = str | EngineSpec | ResolvedEngine


@contextmanager
def engine_here(trace: Trace, spec: Spec = INSTALLED, *, store: Any = None,
                record_dir: str | None = None) -> Iterator[EngineAdapter]:
    """``trace``'s engine, built in this process and closed after the block.

    The only caller of :func:`replayer.engines.open_engine`. ``spec`` must be
    the installed vLLM or the engine a child process imports;
    ``record_dir`` records the replay there through vLLM's own hooks."""
    refuse_unsupported(trace)
    engine = trace.sized_engine()
    # Importing vLLM (first use) and building its engine allocate millions of
    # objects that all survive: fewer GC passes over them (replayer.gc_tuning).
    with engine_hash_seed(engine.hash_seed), fewer_gc_passes():
        adapter = open_engine(engine, resolve(spec), store=store,
                              record_dir=None if record_dir is None else str(record_dir),
                              kv_events=trace.collects_kv_events)
    try:
        yield adapter
    finally:
        adapter.close()


def replay_here(trace: Trace, spec: Spec = INSTALLED, *,
                progress: Callable[[Progress], None] | None = None, store: Any = None,
                record_dir: str | None = None, shortcuts: bool = True,
                sink: Callable[[Any], None] | None = None) -> ReplayResult:
    """Build ``trace``'s engine in this process, replay it, close it; ``sink``
    as :func:`replayer.replay.replay` takes it (in this process only)."""
    t_start = time.perf_counter()
    with engine_here(trace, spec, store=store, record_dir=record_dir) as adapter:
        t_ready = time.perf_counter()
        result = replay(trace, adapter, progress=progress, shortcuts=shortcuts, sink=sink)
    result.timings.update(startup_s=t_ready - t_start, wall_s=time.perf_counter() - t_start)
    return result


@contextmanager
def engine_runner(spec: Spec = INSTALLED, *, own_process: bool = False,
                  env_defaults: dict[str, str] | None = None) -> Iterator[Runner]:
    """A function ``run(trace, progress=, store=, record_dir=, shortcuts=)`` replaying on ``spec``:
    in this process for the installed vLLM, else in one child process kept for
    every call until the ``with`` block ends.

    ``own_process``: the installed vLLM gets a child too, whose interpreter hash
    seed is pinned as the CLI pins its own (the pytest plugin and
    :mod:`replayer.testing`: a test runner's seed is random, and vLLM frees
    blocks from sets whose order depends on it). ``env_defaults``: the child's
    environment where this one's is unset."""
    engine = resolve(spec)
    if engine.runs_here() and not own_process:
        yield partial(replay_here, spec=engine)
        return
    from .engine_process import EngineProcess

    with EngineProcess(engine, installed_too=own_process, env_defaults=env_defaults) as child:
        yield child.replay


def replay_on(trace: Trace, spec: Spec = INSTALLED, **kwargs: Any) -> ReplayResult:
    """One replay of ``trace`` on ``spec`` (its engine process, if any, ends with it)."""
    with engine_runner(spec) as run:
        return run(trace, **kwargs)
