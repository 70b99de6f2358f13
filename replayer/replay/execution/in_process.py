"""An engine built in this process: the one place that opens one.

Every replay, wherever it runs (this process, a child process, a fork of the
warm server's engine), ends here: :func:`engine_here` seeds, builds and
closes the engine, :func:`replay_here` replays a trace on it. Benchmarks that
drive an engine by hand take :func:`engine_here` directly.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from replayer.replay.engines import EngineAdapter, open_engine
from replayer.replay.engines.sources.specs import INSTALLED, EngineSpec, ResolvedEngine, resolve
from replayer.replay.execution.determinism import engine_hash_seed
from replayer.replay.gc_tuning import fewer_gc_passes
from replayer.replay.loop import Progress, ReplayResult, refuse_unsupported, replay
from traces import Trace

Spec = str | EngineSpec | ResolvedEngine
# Tests only: a Python file run in the engine process before each engine is built
# (tests/faults/: planted faults, clearly marked patches of vLLM that `check
# --recompute` must catch). Never set outside the tests.
PLANT_ENV = "PREFIX_REPLAYER_PLANT"


def _run_planted() -> None:
    import os

    path = os.environ.get(PLANT_ENV)
    if path:
        import runpy

        runpy.run_path(path, run_name="replayer_planted_fault")


@contextmanager
def engine_here(trace: Trace, spec: Spec = INSTALLED, *, store: Any = None,
                recorder: Any = None) -> Iterator[EngineAdapter]:
    """``trace``'s engine, built in this process and closed after the block.

    The only caller of :func:`replayer.replay.engines.open_engine`. ``spec`` must be
    the installed vLLM or the engine a child process imports;
    ``recorder``: the caller's hook that records the replay through vLLM's own
    hooks (see :func:`replayer.replay.engines.open_engine`)."""
    refuse_unsupported(trace)
    engine = trace.sized_engine()
    resolved = resolve(spec)
    import_ahead(resolved)
    # Importing vLLM (first use) and building its engine allocate millions of
    # objects that all survive: fewer GC passes over them (.gc_tuning).
    _run_planted()
    with engine_hash_seed(engine.hash_seed), fewer_gc_passes():
        adapter = open_engine(engine, resolved, store=store, recorder=recorder,
                              kv_events=trace.collects_kv_events)
    try:
        yield adapter
    finally:
        adapter.close()


def import_ahead(engine: ResolvedEngine) -> None:
    """A model worker's imports (vLLM's executor and runner, the kernels under
    Triton's interpreter), made and frozen before its first engine is built; a
    child process calls it as soon as it knows its engine, so that its imports
    overlap its parent's work (``check --recompute``'s second engine process).
    Nothing for the null executor, whose imports are light. Once per process."""
    if engine.worker != "model":
        return
    # Triton's interpreter must be chosen before Triton is first imported
    # (replayer.replay.engines.worker.kernels); harmless where no kernel needs it.
    import os
    import sys

    from replayer.replay.engines.worker.kernels import interpreter_env

    if "triton" not in sys.modules:
        os.environ.update(interpreter_env())
    _freeze_imported_heap(engine)


def _freeze_imported_heap(engine: ResolvedEngine) -> None:
    """A model worker's build runs full ``gc.collect()`` passes of its own (vLLM's
    memory profiler around the model's load, its heap freeze after the build), each
    over every object vLLM's and torch's imports left (millions, all alive). With
    those imported first and then frozen, as the warm server's engine parent does,
    each pass walks only what the build made. When passes run changes, never what
    reference counting frees, so no outcome can change. Once per process (a fork of
    the warm server's parent, already frozen, does nothing)."""
    import gc

    if gc.get_freeze_count():
        return
    from replayer.replay.engines import adapter_module_for
    from replayer.replay.engines.worker import executor  # noqa: F401 - vLLM's executor, runner

    __import__(adapter_module_for(engine.info.vllm))
    gc.collect()
    gc.freeze()


def replay_here(trace: Trace, spec: Spec = INSTALLED, *,
                progress: Callable[[Progress], None] | None = None, store: Any = None,
                recorder: Any = None, shortcuts: bool = True,
                sink: Callable[[Any], None] | None = None) -> ReplayResult:
    """Build ``trace``'s engine in this process, replay it, close it; ``sink``
    as :func:`replayer.replay.loop.replay` takes it (in this process only)."""
    t_start = time.perf_counter()
    with engine_here(trace, spec, store=store, recorder=recorder) as adapter:
        t_ready = time.perf_counter()
        result = replay(trace, adapter, progress=progress, shortcuts=shortcuts, sink=sink)
    result.timings.update(startup_s=t_ready - t_start, wall_s=time.perf_counter() - t_start)
    return result
