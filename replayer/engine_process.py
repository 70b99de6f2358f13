"""Replays on a release or a source tree run in a child process.

Only a fresh interpreter can import another vLLM in place of the installed
one: Python keeps every imported module, and vLLM imports itself widely. So
an engine that is not the installed vLLM gets one child process
(``python -m replayer.engine_child``) whose ``sys.path`` starts with a small
overlay directory: ``vllm`` (a link to the release's or tree's package) and a
``vllm-<version>.dist-info`` so that ``importlib.metadata`` agrees with it.
Everything else (torch, the compiled kernels vLLM never needs here, this
package) comes from the installed environment. One child serves every replay
of its :class:`EngineProcess`, builds each engine with the same
:func:`replayer.runner.replay_here` as an in-process replay, and sends back the
same :class:`~replayer.replay.ReplayResult`. Only :mod:`replayer.runner`
starts one.

The child's interpreter hash seed is pinned as the CLI pins its own
(:mod:`replayer.determinism`), so its output is byte-identical across runs.

Wire: the parent writes pickled frames (the engine, then one job per replay)
to the child's stdin; the child answers on a pipe of its own with progress,
result and error frames. The child's stdout goes to the parent's stderr, so
nothing vLLM prints can reach the channel or the parent's ``--json -``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from traces import Trace

from .determinism import INTERPRETER_SEED
from .engines import EngineError, UnsupportedByEngine, check_supported
from .engines.specs import ResolvedEngine
from .replay import ReplayError

REPO_ROOT = Path(__file__).resolve().parent.parent
_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class Job:
    """One replay the child runs (keyword arguments of runner.replay_here)."""

    trace: Trace
    store: Any = None
    record_dir: str | None = None
    shortcuts: bool = True


def send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def recv(stream: BinaryIO) -> Any:
    """The next frame, or None at end of stream."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # a captured stderr (pytest)
        return 2


class EngineProcess:
    """One child process that replays traces on a release or a source tree."""

    def __init__(self, engine: ResolvedEngine, *, installed_too: bool = False,
                 env_defaults: dict[str, str] | None = None) -> None:
        """``installed_too``: the installed vLLM gets a child as well, whose
        interpreter hash seed is pinned (the pytest plugin: pytest's own seed is
        random). ``env_defaults``: the child's environment where this one's is unset."""
        self._env_defaults = dict(env_defaults or {})
        self.engine = engine
        if engine.sources is None and not installed_too:
            raise EngineError(f"engine {self.engine.spec!r} is the installed vLLM; "
                              "it replays in this process")
        self.info = self.engine.info
        self._overlay = Path(tempfile.mkdtemp(prefix="replayer-engine-"))
        self._proc: subprocess.Popen | None = None
        try:
            self._write_overlay()
            self._start()
        except BaseException:
            self.close()
            raise

    def _write_overlay(self) -> None:
        if self.engine.sources is None:             # the installed vLLM: nothing to overlay
            return
        (self._overlay / "vllm").symlink_to(self.engine.sources, target_is_directory=True)
        dist = self._overlay / f"vllm-{self.info.vllm}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {self.info.vllm}\n")

    def _start(self) -> None:
        env = {**self._env_defaults, **os.environ}
        env["PYTHONHASHSEED"] = INTERPRETER_SEED
        paths = [str(self._overlay), str(REPO_ROOT)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        read_fd, write_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "replayer.engine_child", str(write_fd)],
                stdin=subprocess.PIPE, stdout=_stderr_fd(), env=env,
                pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self._answers = os.fdopen(read_fd, "rb")
        assert self._proc.stdin is not None
        send(self._proc.stdin, self.engine)

    def replay(self, trace: Trace, progress: Callable[[Any], None] | None = None,
               store: Any = None, record_dir: str | None = None, shortcuts: bool = True):
        """Replay ``trace`` in the child; same result and errors as in this process."""
        check_supported(self.info.vllm, trace.engine, self.info.label)
        if self._proc is None or self._proc.stdin is None:
            raise EngineError(f"{self.info.label}: the engine process is closed")
        try:
            send(self._proc.stdin, Job(trace, store, None if record_dir is None
                                       else str(record_dir), shortcuts))
        except BrokenPipeError:
            pass                                    # reported below, with the exit code
        while True:
            frame = recv(self._answers)
            if frame is None:
                code = self._proc.wait()
                raise EngineError(f"{self.info.label}: the engine process exited with code "
                                  f"{code} before answering (--verbose shows vLLM's output)")
            kind = frame[0]
            if kind == "progress":
                if progress is not None:
                    progress(frame[1])
            elif kind == "result":
                return frame[1]
            elif kind == "error":
                raise _error_class(frame[1])(frame[2])
            else:                                   # "crash": a bug, shown in full
                raise RuntimeError(f"{self.info.label}: the engine process failed:\n{frame[1]}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            self._answers.close()
        shutil.rmtree(self._overlay, ignore_errors=True)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _error_class(name: str) -> type[Exception]:
    """The parent's class for an error the child reported; the message says the rest."""
    return {"UnsupportedByEngine": UnsupportedByEngine,
            "ReplayError": ReplayError}.get(name, EngineError)
