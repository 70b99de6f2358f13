"""Frames between a client and an engine process: length-prefixed pickles.

One format for every channel: a child process's pipes
(:mod:`.child_process`) and the warm server's Unix socket (:mod:`.warm`).
A replay's answer is a sequence of frames ``("progress", Progress)``, then
one of ``("result", ReplayResult)``, ``("error", class name, message)`` (bad
input, raised again on the client's side as the same class) or
``("crash", traceback)`` (a bug, shown in full). Pickle is safe here because
both ends are this user's own processes (the socket is the user's, mode 0600).
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class Job:
    """One replay an engine process runs (keyword arguments of ``replay_here``)."""

    trace: Any
    store: Any = None
    # Called with the engine's vLLM config before it is built (open_engine's
    # ``recorder``); a module-level function or a partial of one, so it pickles.
    recorder: Any = None
    shortcuts: bool = True
    # Whether the caller takes progress: a frame for every engine step (callers
    # use it as a per-step hook), or none at all (explain's parallel replays:
    # a frame per step kept the client busy beside two forks on 2 cores).
    progress: bool = True


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def decode(message: bytes) -> Any:
    """A frame received whole (one datagram of a SOCK_SEQPACKET socket)."""
    size = _HEADER.unpack_from(message)[0]
    return pickle.loads(message[_HEADER.size:_HEADER.size + size])


def send(stream: BinaryIO, obj: Any) -> None:
    stream.write(encode(obj))
    stream.flush()


def recv(stream: BinaryIO) -> Any:
    """The next frame, or None at end of stream (or a frame cut short)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class AnswerLost(Exception):
    """The engine process's stream ended before a whole answer; ``reason`` says
    how, where the far end could tell (a warm fork killed by its limit)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_answer(stream: BinaryIO, progress: Any, label: str) -> Any:
    """The replay result read from ``stream``: progress frames go to ``progress``,
    an error frame is raised again as its class, a crash as RuntimeError, and
    an answer cut short as :class:`AnswerLost`."""
    while True:
        frame = recv(stream)
        if frame is None:
            raise AnswerLost("ended before answering")
        kind = frame[0]
        if kind == "progress":
            if progress is not None:
                progress(frame[1])
        elif kind == "result":
            return frame[1]
        elif kind == "error":
            raise rebuild_error(frame[1], frame[2])
        elif kind == "crash":                       # a bug, shown in full
            raise RuntimeError(f"{label}: the engine process failed:\n{frame[1]}")
        elif kind == "lost":                        # a warm fork's parent: why it died
            raise AnswerLost(frame[1])
        else:
            raise AnswerLost(f"sent an unexpected frame {kind!r}")


def rebuild_error(name: str, message: str) -> Exception:
    """The client's exception for an error an engine process reported by class
    name: the same class where it is one of the replay's own (a full disk's
    RecordingError stays one), else EngineError; ``str()`` is the message."""
    from replayer.replay.engines import EngineError, UnsupportedByEngine
    from replayer.replay.loop import ReplayError
    from traces import TraceError
    from traces.io.parts import RecordingError

    known: dict[str, type[Exception]] = {
        c.__name__: c for c in (UnsupportedByEngine, ReplayError, TraceError,
                                RecordingError, EngineError)}
    try:
        from replayer.replay.store import StoreError

        known["StoreError"] = StoreError
    except ImportError:  # pragma: no cover - the store package is optional here
        pass
    cls = known.get(name, EngineError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)                # no re-formatting: the message as sent
    if isinstance(exc, TraceError):
        exc.path, exc.message, exc.column, exc.row = "", message, None, None
    return exc


def answer_frames(replay: Any, job: Job, answers: BinaryIO) -> None:
    """Run ``replay(job, progress)`` and write its answer frames to ``answers``.

    Bad input becomes an ``error`` frame, anything else a ``crash`` frame; the
    same in a child process and in a warm server's fork."""
    import traceback

    from replayer.replay.engines import EngineError
    from replayer.replay.loop import ReplayError
    from traces import TraceError

    bad_input: tuple[type[BaseException], ...] = (TraceError, EngineError, ReplayError)
    try:
        from replayer.replay.store import StoreError

        bad_input += (StoreError,)
    except ImportError:  # pragma: no cover - the store package is optional here
        pass

    def progress(p: Any) -> None:
        send(answers, ("progress", p))

    try:
        result = replay(job, progress if job.progress else None)
        send(answers, ("result", result))
    except bad_input as exc:
        send(answers, ("error", type(exc).__name__, str(exc)))
    except BrokenPipeError:
        raise                                       # the client is gone: nobody to tell
    except BaseException:  # noqa: BLE001 - sent to the client, which raises it
        send(answers, ("crash", traceback.format_exc()))
