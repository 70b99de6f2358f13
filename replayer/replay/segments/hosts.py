"""Where segment workers run: this process, a local process pool, processes that
import a release (or a source tree) of their own, or a Ray cluster.

A host has a few slots (processes, or Ray actors), each running the calls sent
to it one after another, in order: ``open`` a segment's worker from its part
of the trace (shipped once), then ``begin``, ``run_on``, ``extend``, ``finish`` or
``close`` it. Every call returns a :class:`concurrent.futures.Future`, so the
head waits for whichever answer it needs next, wherever it came from. A slot
keeps its interpreter (vLLM imported once) for every replay of a command
(``explain`` runs several), and may hold several paused segments when there
are more segments than slots. A host's ``startup_s`` (its processes started)
is charged to the first replay on it.

Every slot runs under the pinned interpreter hash seed, with this checkout
importable and vLLM quiet, as the sweep's workers do; what a slot prints goes
to stderr, so nothing reaches a ``--json -`` on stdout.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any

from replayer import SOURCE_ROOT
from replayer.replay.execution.determinism import INTERPRETER_SEED

_STOP = object()


class Slots:
    """The segment workers of one slot, keyed by (replay, segment): what a call does."""

    def __init__(self) -> None:
        self.workers: dict[Any, Any] = {}

    def call(self, key: Any, method: str, args: tuple) -> Any:
        if method == "open":
            from replayer.replay.segments.worker import SegmentWorker

            self.workers[key] = SegmentWorker(*args)
            return None
        if method == "close":
            worker = self.workers.pop(key, None)
            if worker is not None:
                worker.close()
            return None
        worker = self.workers[key]
        try:
            return getattr(worker, method)(*args)
        except BaseException:
            self.workers.pop(key, None)
            worker.close()
            raise
        finally:
            if method == "finish":
                self.workers.pop(key, None)

    def answer(self, key: Any, method: str, args: tuple) -> tuple:
        """The call's answer as a frame: ("ok", value) or ("error", class, message)."""
        from replayer.replay.engines import EngineError
        from replayer.replay.loop import ReplayError
        from traces import TraceError

        try:
            return ("ok", self.call(key, method, args))
        except (TraceError, EngineError, ReplayError) as exc:
            return ("error", type(exc).__name__, str(exc))
        except Exception:  # noqa: BLE001 - a bug: shown whole on the head's side
            return ("crash", traceback.format_exc())

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


def _resolve(fut: Future, frame: tuple, where: str) -> None:
    from replayer.replay.execution.wire import rebuild_error

    if frame[0] == "ok":
        fut.set_result(frame[1])
    elif frame[0] == "error":
        fut.set_exception(rebuild_error(frame[1], frame[2]))
    else:
        fut.set_exception(RuntimeError(f"segment worker in {where} failed:\n{frame[1]}"))


class InProcessHost:
    """One slot: this process, each call run as it is made."""

    kind = "this process"
    startup_s = 0.0
    imports_vllm_once = False

    def __init__(self) -> None:
        self.slots = 1
        self._slot = Slots()

    def describe(self) -> str:
        return "in this process, one after another"

    def call(self, slot: int, key: Any, method: str, *args: Any) -> Future:
        fut: Future = Future()
        _resolve(fut, self._slot.answer(key, method, args), "this process")
        return fut

    def close(self) -> None:
        self._slot.close()


def _pinned_env(verbose: bool) -> dict[str, str]:
    from replayer.replay.execution.environment import OFFLINE_ENV, QUIET_ENV, VERBOSE_ENV

    env = {**OFFLINE_ENV, "PYTHONHASHSEED": INTERPRETER_SEED}
    env.update({VERBOSE_ENV: "1"} if verbose else QUIET_ENV)
    return env


HEAD_ENV = "PREFIX_REPLAYER_SEGMENT_HEAD"


def exit_when_gone(pid: int) -> None:
    """End this process once ``pid`` (the head) is gone: a head killed by a signal
    never closes its pool, and its processes would replay on for nobody."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
    threading.Thread(target=watch, daemon=True, name="replayer-head-watch").start()


def serve(conn: Any, verbose: bool, head: int | None = None) -> None:
    """A pool process: answer calls from ``conn`` until it closes (or the head dies)."""
    if head is not None:
        exit_when_gone(head)
    os.dup2(2, 1)                        # nothing printed here reaches the head's stdout
    from replayer.replay.execution.environment import quiet_vllm

    quiet_vllm(verbose)
    slot = Slots()
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            conn.send(slot.answer(*msg))
    finally:
        slot.close()


def _slot_env(verbose: bool) -> Any:
    """The environment a pool process (or its fork server) starts with, set for
    the ``with`` block and restored after (a child reads it when it starts)."""
    from unittest import mock

    return mock.patch.dict(os.environ, {
        **_pinned_env(verbose), HEAD_ENV: str(os.getpid()),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT),
                                                    os.environ.get("PYTHONPATH")]))})


class _PoolSlot:
    """One pool process and the thread that sends it calls and reads its answers."""

    def __init__(self, ctx: Any, index: int, verbose: bool) -> None:
        self.index = index
        parent, child = ctx.Pipe()
        with _slot_env(verbose):
            self.process = ctx.Process(target=serve, args=(child, verbose, os.getpid()),
                                       daemon=True,
                                       name=f"replayer-segment-{index}")
            self.process.start()
        child.close()
        self._serve(parent)

    def _serve(self, conn: Any) -> None:
        self.conn = conn
        self.calls: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._pump, daemon=True,
                                       name=f"replayer-segment-pump-{self.index}")
        self.thread.start()

    def _pump(self) -> None:
        while True:
            item = self.calls.get()
            if item is _STOP:
                return
            msg, fut = item
            try:
                self.conn.send(msg)
                frame = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self.process.exitcode
                fut.set_exception(RuntimeError(
                    f"segment process {self.index} exited (code {code}) before answering"))
                continue
            _resolve(fut, frame, f"process {self.index}")

    def close(self) -> None:
        self.calls.put(_STOP)
        self.thread.join(timeout=60)
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


# The fork server's log level, once started (it is one per process, started with
# the environment of its first pool): None until then.
_FORK_SERVER_VERBOSE: list[bool] = []
# When start_fork_server started it ahead of a pool (perf_counter), until a pool counts it.
_STARTED_AHEAD: list[float] = []


def start_fork_server(verbose: bool = False) -> None:
    """Start the pool's fork server now, so it imports vLLM while the caller
    reads and plans its trace (a pool made later forks from it at once)."""
    ctx = _pool_context(verbose)
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    t0 = time.perf_counter()
    with _slot_env(verbose):
        forkserver.ensure_running()
    _STARTED_AHEAD[:] = [t0]


def _pool_context(verbose: bool) -> Any:
    """Processes forked from one server that imported vLLM once (.preload), or
    spawned where that server runs at another log level (or forks cannot be)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    if _FORK_SERVER_VERBOSE and _FORK_SERVER_VERBOSE[0] != verbose:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    if not _FORK_SERVER_VERBOSE:
        ctx.set_forkserver_preload(["replayer.replay.segments.preload"])
        _FORK_SERVER_VERBOSE.append(verbose)
    return ctx


class PoolHost:
    """A local process pool: ``processes`` interpreters started at once, forked
    from a server that imports vLLM once for them all (the first pool's slot
    starts it, under the slots' environment)."""

    kind = "pool"
    # Its start-up (the fork server importing vLLM) is a sequential replay's too.
    imports_vllm_once = True

    def __init__(self, processes: int, verbose: bool = False) -> None:
        t0 = time.perf_counter()
        ctx = _pool_context(verbose)
        self.slots = max(1, processes)
        self._slots: list[_PoolSlot] = []
        try:
            for i in range(self.slots):
                self._slots.append(_PoolSlot(ctx, i, verbose))
        except BaseException:
            self.close()
            raise
        # From the fork server's start, where it was started ahead (its import).
        self.startup_s = time.perf_counter() - min([t0, *_STARTED_AHEAD])
        _STARTED_AHEAD.clear()

    def describe(self) -> str:
        return f"on a local process pool of {self.slots}"

    def call(self, slot: int, key: Any, method: str, *args: Any) -> Future:
        fut: Future = Future()
        self._slots[slot % self.slots].calls.put(((key, method, args), fut))
        return fut

    def close(self) -> None:
        for s in self._slots:
            s.close()
        self._slots = []


class _ReleaseProcess:
    """A child interpreter seen as a multiprocessing process (what :class:`_PoolSlot`
    reads of one: its exit code, join, is_alive, kill)."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def join(self, timeout: float | None = None) -> None:
        import subprocess

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()


class _ReleaseSlot(_PoolSlot):
    """One slot in an interpreter of its own whose ``sys.path`` starts with a
    release's (or a source tree's) vLLM: only a fresh interpreter can import
    another vLLM than the installed one (as :mod:`replayer.replay.execution.child_process`
    does for a whole replay). It answers the same calls over a socket."""

    def __init__(self, engine: Any, overlay: str, index: int, verbose: bool) -> None:
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection
        from pathlib import Path

        from replayer.replay.execution.environment import engine_env, stderr_fd

        self.index = index
        parent, child = socket.socketpair()
        base = {**os.environ, **_pinned_env(verbose)}
        env = engine_env(engine, Path(overlay), base=base)
        try:
            proc = subprocess.Popen(
                [engine.interpreter or sys.executable, "-m", "replayer.replay.segments.slot_main",
                 str(child.fileno()), "1" if verbose else "0", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=stderr_fd(), env=env,
                pass_fds=(child.fileno(),))
        finally:
            child.close()
        self.process = _ReleaseProcess(proc)
        self._serve(Connection(parent.detach()))


class ReleaseHost:
    """Processes of their own for a release or a source tree: ``processes``
    interpreters, each importing that vLLM (no fork server can share one import
    with this process, which imported another vLLM or none)."""

    kind = "release processes"
    imports_vllm_once = False        # each process imports the release in its first start-up

    def __init__(self, engine: Any, processes: int, verbose: bool = False) -> None:
        import shutil
        import tempfile
        from pathlib import Path

        from replayer.replay.execution.environment import write_overlay

        t0 = time.perf_counter()
        self.engine = engine
        self.slots = max(1, processes)
        self._overlay = tempfile.mkdtemp(prefix="replayer-segments-")
        self._slots: list[_PoolSlot] = []
        try:
            write_overlay(engine, Path(self._overlay))
            for i in range(self.slots):
                self._slots.append(_ReleaseSlot(engine, self._overlay, i, verbose))
        except BaseException:
            self.close()
            shutil.rmtree(self._overlay, ignore_errors=True)
            raise
        self.startup_s = time.perf_counter() - t0

    def describe(self) -> str:
        return f"on {self.slots} process(es) importing {self.engine.info.label}"

    call = PoolHost.call

    def close(self) -> None:
        import shutil

        for s in self._slots:
            s.close()
        self._slots = []
        shutil.rmtree(self._overlay, ignore_errors=True)


class _RayActor:
    """A Ray actor holding segment workers (Ray runs an actor's calls in order)."""

    def __init__(self, verbose: bool) -> None:
        from replayer.replay.execution.environment import quiet_vllm

        quiet_vllm(verbose)
        self.slot = Slots()

    def answer(self, key: Any, method: str, args: tuple) -> tuple:
        return self.slot.answer(key, method, args)

    def ready(self) -> bool:
        return True


class RayHost:
    """A Ray cluster (``address``: ``auto``, ``ray://HOST:PORT``; None starts one
    here): one actor per CPU the cluster has, at most ``slots``."""

    kind = "ray"
    imports_vllm_once = False        # each actor imports vLLM in its first segment's start-up

    def __init__(self, address: str | None, slots: int, verbose: bool = False) -> None:
        from traces import TraceError

        t0 = time.perf_counter()
        try:
            import ray
        except ImportError:
            raise TraceError("--ray", "Ray is not installed (pip install "
                                      "'prefix-replayer[ray]')") from None
        self._ray = ray
        self.address = address
        self._started = False
        if not ray.is_initialized():
            env = {**_pinned_env(verbose), "PYTHONPATH": os.pathsep.join(
                filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))}
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                     include_dashboard=False, logging_level="ERROR")
            self._started = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, min(slots, cpus))
        actor = ray.remote(num_cpus=1)(_RayActor)
        self._actors = [actor.remote(verbose) for _ in range(self.slots)]
        self.startup_s = time.perf_counter() - t0

    def describe(self) -> str:
        where = "local" if self.address is None else self.address
        return f"on Ray ({where}) with {self.slots} worker(s)"

    def call(self, slot: int, key: Any, method: str, *args: Any) -> Future:
        ref = self._actors[slot % self.slots].answer.remote(key, method, args)
        raw = ref.future()
        fut: Future = Future()

        def done(f: Future) -> None:
            try:
                _resolve(fut, f.result(), f"Ray actor {slot % self.slots}")
            except BaseException as exc:  # noqa: BLE001 - the actor died: say so there
                fut.set_exception(RuntimeError(f"Ray actor {slot % self.slots}: {exc}"))
        raw.add_done_callback(done)
        return fut

    def close(self) -> None:
        for a in self._actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - a dead actor is already gone
                pass
        self._actors = []
        if self._started:
            self._ray.shutdown()


def make_host(ray: str | None, jobs: int | None, segments: int, verbose: bool = False,
              engine: Any = None) -> Any:
    """Where the segments run: Ray (``ray``: an address, or ``local`` for an
    instance started here), this process (``jobs`` 1), or a local pool of at
    most ``jobs`` processes (default: the cores there are). ``engine`` (a
    resolved engine) that does not run here (a release, a source tree): at most
    ``jobs`` processes that import it (one with ``jobs`` 1); not on Ray."""
    if engine is not None and not engine.runs_here():
        if ray:
            from traces import TraceError

            raise TraceError("--ray", f"not with {engine.info.label}: its vLLM is imported "
                                      "by processes started here (Ray's actors import the "
                                      "installed one)")
        return ReleaseHost(engine, min(segments, jobs or os.cpu_count() or 1), verbose)
    if ray:
        return RayHost(None if ray == "local" else ray, segments, verbose)
    if jobs == 1:
        return InProcessHost()
    return PoolHost(min(segments, jobs or os.cpu_count() or 1), verbose)
