"""One interface to an engine, wherever it runs: :func:`make_client`.

As vLLM's ``EngineCoreClient`` hides whether its engine core runs in this
process or another behind ``make_client``, an :class:`EngineClient` replays
traces on one engine and hides where:

* :class:`InProcessClient`: the installed vLLM, in this process (the CLI,
  whose interpreter hash seed is pinned by its re-exec);
* :class:`~.child_process.EngineProcess`: a child process of its own, for a
  release or a source tree (only a fresh interpreter can import another
  vLLM), and for callers whose own hash seed is not pinned (the pytest
  plugin, ``replayer.pytest.testing``);
* :class:`~.warm.client.WarmClient`: a fork of the warm server's
  pre-imported engine (``replayer server start``), used whenever that server
  runs, with either of the above as its cold fallback.

Every implementation ends in :func:`.in_process.replay_here`, so the result
is the same object, byte for byte, whichever ran it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol, Sequence

from replayer.replay.engines.base import EngineInfo
from replayer.replay.engines.sources.specs import INSTALLED, EngineSpec, ResolvedEngine, resolve
from replayer.replay.execution.cold_starts import note_cold_start
from replayer.replay.loop import ReplayResult
from traces import Trace

Spec = str | EngineSpec | ResolvedEngine

class EngineClient(Protocol):
    """Replays traces on one engine: ``client(trace, progress=, store=,
    recorder=, shortcuts=)``; :meth:`replay_many` runs several at once where
    the implementation can."""

    info: EngineInfo
    in_process: bool        # replays in this process (may take a streamed trace, a sink)
    parallel: bool          # replay_many runs its traces side by side

    def __call__(self, trace: Trace, progress: Callable[[Any], None] | None = None,
                 store: Any = None, recorder: Any = None,
                 shortcuts: bool = True, **kw: Any) -> ReplayResult: ...

    def replay_many(self, traces: Sequence[Trace], store: Any = None) -> list[ReplayResult]: ...

    def close(self) -> None: ...


class InProcessClient:
    """The installed vLLM, built in this process for each replay."""

    in_process = True
    parallel = False

    def __init__(self, engine: ResolvedEngine) -> None:
        self.engine = engine
        self.info = engine.info

    def __call__(self, trace: Trace, progress: Callable[[Any], None] | None = None,
                 store: Any = None, recorder: Any = None, shortcuts: bool = True,
                 sink: Callable[[Any], None] | None = None) -> ReplayResult:
        from replayer.replay.execution.in_process import replay_here

        return note_cold_start(replay_here(trace, self.engine, progress=progress, store=store,
                                           recorder=recorder, shortcuts=shortcuts, sink=sink))

    def replay_many(self, traces: Sequence[Trace], store: Any = None) -> list[ReplayResult]:
        return [self(t, store=store) for t in traces]

    def close(self) -> None:
        pass


def interpreter_seed_pinned() -> bool:
    """Whether this interpreter's string hashes are the pinned ones (PYTHONHASHSEED=0)."""
    return sys.flags.hash_randomization == 0


def cold_client(engine: ResolvedEngine, *, own_process: bool = False,
                env_defaults: dict[str, str] | None = None) -> EngineClient:
    """This process for the installed vLLM, else a child process."""
    if engine.runs_here() and not own_process:
        return InProcessClient(engine)
    from replayer.replay.execution.child_process import EngineProcess

    return EngineProcess(engine, installed_too=own_process, env_defaults=env_defaults)


def warm_server_running() -> bool:
    """Whether a warm server for this environment is there (and not opted out of);
    with PREFIX_REPLAYER_AUTO_SERVER=1, one is started if none is (:mod:`.warm.auto`)."""
    from replayer.replay.execution.warm import auto, paths

    if not paths.server_wanted():
        return False
    return paths.server_socket().exists() or auto.start_if_wanted()


def runs_in_this_process(spec: Spec = INSTALLED) -> bool:
    """Whether :func:`make_client` would replay ``spec`` in this process (so the
    caller may hand it things that cannot cross processes: a streamed trace, a sink)."""
    engine = resolve(spec)
    return engine.runs_here() and not warm_server_running()


def make_client(spec: Spec = INSTALLED, *, own_process: bool = False,
                env_defaults: dict[str, str] | None = None,
                use_server: bool | None = None) -> EngineClient:
    """The client for ``spec``: the warm server's when one runs (and
    ``use_server`` is not False, nor ``--no-server`` / PREFIX_REPLAYER_NO_SERVER
    said), else a cold one (:func:`cold_client`).

    ``own_process``: the installed vLLM runs in a child too, whose hash seed is
    pinned (callers whose own seed is random). ``env_defaults``: the engine
    process's environment where this one's is unset."""
    engine = resolve(spec)
    # The warm server forks pre-imported engines, one parent per environment and
    # worker (a model worker's with its kernels and tiny models' code imported).
    if use_server is not False and warm_server_running():
        from replayer.replay.execution.warm.client import WarmClient

        return WarmClient(engine, env_defaults=env_defaults, cold=lambda: cold_client(
            engine, own_process=own_process or not interpreter_seed_pinned(),
            env_defaults=env_defaults))
    return cold_client(engine, own_process=own_process, env_defaults=env_defaults)


@contextmanager
def engine_runner(spec: Spec = INSTALLED, *, own_process: bool = False,
                  env_defaults: dict[str, str] | None = None,
                  use_server: bool | None = None) -> Iterator[EngineClient]:
    """:func:`make_client`'s client for the ``with`` block, closed after it."""
    client = make_client(spec, own_process=own_process, env_defaults=env_defaults,
                         use_server=use_server)
    try:
        yield client
    finally:
        client.close()


def references_side_by_side() -> bool:
    """Whether ``check --recompute`` runs its two references at once (:func:`beside`).

    Only worth it with a core to spare: the second engine process costs its own
    start (vLLM's imports). ``PREFIX_REPLAYER_SERIAL_REFERENCES=1`` runs them one
    after the other in the one process (the suite sets it: two xdist workers
    already take both of CI's cores). The verdicts are the same bytes either way."""
    return os.environ.get("PREFIX_REPLAYER_SERIAL_REFERENCES", "") in ("", "0")


@contextmanager
def beside(client: EngineClient) -> Iterator[EngineClient]:
    """A client whose replays may run at the same time as ``client``'s, for the
    ``with`` block: ``client`` itself where its replays run side by side (the
    warm server's forks of a null-executor engine; it forks one model worker at
    a time, whose torch takes every core), else a second engine process of the
    same engine, started now so that its imports overlap what ``client`` does
    meanwhile (``check --recompute``'s two references), closed after the block."""
    if client.parallel and client.info.worker != "model":
        yield client
        return
    side = cold_client(client.engine, own_process=True,   # type: ignore[attr-defined]
                       env_defaults=getattr(client, "_env_defaults", None))
    try:
        yield side
    finally:
        side.close()


def replay_on(trace: Trace, spec: Spec = INSTALLED, **kwargs: Any) -> ReplayResult:
    """One replay of ``trace`` on ``spec`` (its engine process, if any, ends with it)."""
    with engine_runner(spec) as run:
        return run(trace, **kwargs)
