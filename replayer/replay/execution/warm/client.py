"""The client side of the warm server: a replay on a fresh fork, or a cold one.

:class:`WarmClient` is the :class:`~replayer.replay.execution.clients.EngineClient`
that :func:`~replayer.replay.execution.clients.make_client` returns while a server
runs. Each replay is one connection: the client sends its engine, the
fingerprint of its sources, its environment, working directory and stderr;
the server answers with notes (an engine starting or restarting) and hands
the connection to a fork, which says ``ready``, takes the job and answers
with the frames of :mod:`replayer.replay.execution.wire`. A server that is gone,
refuses, or stays silent means a cold replay (one line on stderr, once per
client): never a hang, never a wrong answer. A fork killed by its limits is
reported as the replay's error, not retried.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from replayer.replay.engines import EngineError, check_supported
from replayer.replay.execution.environment import stderr_fd
from replayer.replay.execution.warm.protocol import PROTOCOL
from replayer.replay.execution.warm import paths
from replayer.replay.execution.warm.fingerprint import engine_fingerprint, environment_key
from replayer.replay.execution.wire import AnswerLost, Job, encode, read_answer, recv, send

# The server answers a request at once (a note, or the fork's ready) unless it
# is starting an engine parent, which it says first; then it may take minutes.
FIRST_ANSWER_S = 20.0
START_S = 900.0


class ServerUnavailable(Exception):
    """No warm replay could be had; the message says why."""


def request(op: str, timeout: float = 10.0, say_notes: bool = True, **fields: Any) -> Any:
    """One request to the server and its first answer (ping, status, stop, warm)."""

    sock = _connect(timeout)
    try:
        sock.sendall(encode({"protocol": PROTOCOL, "op": op, **fields}))
        stream = sock.makefile("rb")
        while True:
            frame = recv(stream)
            if frame is None:
                raise ServerUnavailable("the server closed the connection")
            if frame[0] not in ("note", "wait"):
                return frame
            if frame[0] == "note" and say_notes:
                print(f"replayer: {frame[1]}", file=sys.stderr, flush=True)
            sock.settimeout(START_S)
    except socket.timeout:
        raise ServerUnavailable(f"no answer within {timeout:g} s") from None
    except ConnectionError:
        # Connected while the server was stopping (its idle timeout, a stop):
        # it closed the listening socket with this connection still queued.
        raise ServerUnavailable("the server closed the connection") from None
    finally:
        sock.close()


def _connect(timeout: float) -> socket.socket:
    path = paths.server_socket()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise ServerUnavailable(f"cannot connect to {path} ({exc.strerror or exc})") from None
    return sock


class WarmClient:
    """Replays on the warm server; ``cold()`` makes the fallback client."""

    in_process = False
    parallel = True                                 # replay_many runs side by side

    def __init__(self, engine: Any, *, cold: Callable[[], Any],
                 env_defaults: dict[str, str] | None = None) -> None:
        self.engine = engine
        self.info = engine.info
        self._cold_factory = cold
        self._cold: Any = None
        self._env_defaults = dict(env_defaults or {})
        self._lock = threading.Lock()
        self._cold_lock = threading.Lock()
        self.warm_replays = 0                       # tests and the benchmark read these
        self.cold_replays = 0

    def __call__(self, trace: Any, progress: Callable[[Any], None] | None = None,
                 store: Any = None, recorder: Any = None,
                 shortcuts: bool = True) -> Any:
        check_supported(self.info.vllm, trace.engine, self.info.label, self.info.worker)
        job = Job(trace, store, recorder, shortcuts, progress is not None)
        if self._cold is None:
            try:
                result = self._warm(job, progress)
                with self._lock:
                    self.warm_replays += 1
                return result
            except ServerUnavailable as exc:
                self._fall_back(str(exc))
        # A cold client replays one trace at a time (one child, or this process):
        # replay_many's threads take turns.
        with self._cold_lock:
            self.cold_replays += 1
            return self._cold(trace, progress=progress, store=store, recorder=recorder,
                              shortcuts=shortcuts)

    def replay_many(self, traces: Sequence[Any], store: Any = None) -> list[Any]:
        """All at once, each on its own fork (the server runs one per core); in order."""
        if len(traces) <= 1 or self._cold is not None:
            return [self(t, store=store) for t in traces]
        with ThreadPoolExecutor(max_workers=len(traces)) as pool:
            return list(pool.map(lambda t: self(t, store=store), traces))

    def close(self) -> None:
        if self._cold is not None:
            self._cold.close()

    def _fall_back(self, why: str) -> None:
        with self._lock:
            if self._cold is None:
                print(f"replayer: warm server unavailable ({why}); replaying cold",
                      file=sys.stderr, flush=True)
                self._cold = self._cold_factory()

    def _hello(self) -> dict[str, Any]:

        env = {**self._env_defaults, **os.environ}
        return {"protocol": PROTOCOL, "op": "replay", "engine": self.engine,
                "fingerprint": engine_fingerprint(self.engine), "env": env,
                "env_key": list(environment_key(env)), "cwd": os.getcwd()}

    def _warm(self, job: Job, progress: Callable[[Any], None] | None) -> Any:
        sock = _connect(FIRST_ANSWER_S)
        try:
            try:
                socket.send_fds(sock, [encode(self._hello())], [stderr_fd()])
                stream = sock.makefile("rwb")
                while True:
                    frame = recv(stream)
                    if frame is None:
                        raise ServerUnavailable("the server closed the connection")
                    if frame[0] == "note":          # a stale engine restarted, say
                        print(f"replayer: {frame[1]}", file=sys.stderr, flush=True)
                        sock.settimeout(START_S)
                    elif frame[0] == "wait":        # an engine starting: minutes at most
                        sock.settimeout(START_S)
                    elif frame[0] == "queued":      # an engine parent holds it: EOF if it dies
                        sock.settimeout(None)
                    elif frame[0] == "refused":
                        raise ServerUnavailable(frame[1])
                    elif frame[0] == "ready":
                        break
                    else:
                        raise ServerUnavailable(f"unexpected answer {frame[0]!r}")
            except socket.timeout:
                raise ServerUnavailable("no answer in time") from None
            except (OSError, EOFError) as exc:
                raise ServerUnavailable(f"{type(exc).__name__}: {exc}") from None
            sock.settimeout(None)                   # a replay takes what it takes
            send(stream, job)
            try:
                return read_answer(stream, progress, f"{self.info.label} (warm)")
            except AnswerLost as exc:
                raise EngineError(f"{self.info.label}: the warm replay {exc.reason}") from None
        finally:
            sock.close()
