"""Replays on a release or a source tree run in a child process.

Only a fresh interpreter can import another vLLM in place of the installed
one: Python keeps every imported module, and vLLM imports itself widely. So
an engine that is not the installed vLLM gets one child process
(``python -m replayer.replay.execution.child_main``) whose ``sys.path`` starts with a small
overlay directory: ``vllm`` (a link to the release's or tree's package) and a
``vllm-<version>.dist-info`` so that ``importlib.metadata`` agrees with it.
Everything else (torch, the compiled kernels vLLM never needs here, this
package) comes from the installed environment. One child serves every replay
of its :class:`EngineProcess`, builds each engine with the same
:func:`replayer.replay.execution.in_process.replay_here` as an in-process replay, and sends back the
same :class:`~replayer.replay.loop.ReplayResult`. Only :mod:`replayer.replay.execution.clients`
starts one.

The child's interpreter hash seed is pinned as the CLI pins its own
(:mod:`.determinism`), so its output is byte-identical across runs.

Wire: the parent writes pickled frames (the engine, then one job per replay)
to the child's stdin; the child answers on a pipe of its own with progress,
result and error frames. The child's stdout goes to the parent's stderr, so
nothing vLLM prints can reach the channel or the parent's ``--json -``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from replayer.replay.engines import EngineError, check_supported
from replayer.replay.engines.sources.specs import ResolvedEngine
from replayer.replay.execution.cold_starts import note_cold_start
from replayer.replay.execution.environment import engine_env, stderr_fd, write_overlay
from replayer.replay.execution.wire import AnswerLost, Job, read_answer, send
from traces import Trace

class EngineProcess:
    """One child process that replays traces on a release or a source tree
    (an :class:`~.clients.EngineClient`)."""

    in_process = False
    parallel = False

    def __init__(self, engine: ResolvedEngine, *, installed_too: bool = False,
                 env_defaults: dict[str, str] | None = None) -> None:
        """``installed_too``: the installed vLLM gets a child as well, whose
        interpreter hash seed is pinned (the pytest plugin: pytest's own seed is
        random). ``env_defaults``: the child's environment where this one's is unset."""
        self._env_defaults = dict(env_defaults or {})
        self.engine = engine
        if engine.sources is None and engine.interpreter is None and not installed_too:
            raise EngineError(f"engine {self.engine.spec!r} is the installed vLLM; "
                              "it replays in this process")
        self.info = self.engine.info
        self._overlay = Path(tempfile.mkdtemp(prefix="replayer-engine-"))
        self._proc: subprocess.Popen | None = None
        try:
            write_overlay(self.engine, self._overlay)
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        env = engine_env(self.engine, self._overlay, self._env_defaults)
        read_fd, write_fd = os.pipe()
        try:
            python = self.engine.interpreter or sys.executable   # an environment's own
            self._proc = subprocess.Popen(
                [python, "-m", "replayer.replay.execution.child_main", str(write_fd)],
                stdin=subprocess.PIPE, stdout=stderr_fd(), env=env,
                pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self._answers = os.fdopen(read_fd, "rb")
        assert self._proc.stdin is not None
        send(self._proc.stdin, self.engine)

    def replay(self, trace: Trace, progress: Callable[[Any], None] | None = None,
               store: Any = None, recorder: Any = None, shortcuts: bool = True):
        """Replay ``trace`` in the child; same result and errors as in this process."""
        check_supported(self.info.vllm, trace.engine, self.info.label, self.info.worker)
        if self._proc is None or self._proc.stdin is None:
            raise EngineError(f"{self.info.label}: the engine process is closed")
        try:
            send(self._proc.stdin, Job(trace, store, recorder, shortcuts,
                                       progress is not None))
        except BrokenPipeError:
            pass                                    # reported below, with the exit code
        try:

            return note_cold_start(read_answer(self._answers, progress, self.info.label))
        except AnswerLost:
            code = self._proc.wait()
            raise EngineError(f"{self.info.label}: the engine process exited with code "
                              f"{code} before answering (--verbose shows vLLM's output)") from None

    __call__ = replay

    def replay_many(self, traces: Sequence[Trace], store: Any = None) -> list[Any]:
        """One after the other: the child replays one trace at a time."""
        return [self.replay(t, store=store) for t in traces]

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

