"""The child side of :mod:`.child_process`: replays jobs on the vLLM it imports.

Started as ``python -m replayer.replay.execution.child_main FD`` with a release's or
a tree's sources first on ``sys.path``; reads the engine, then one job per
replay, from stdin, replays each with :func:`.in_process.replay_here` and
answers on ``FD`` (progress, result, or the error the parent raises again).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn

from replayer.replay.execution.in_process import import_ahead, replay_here
from replayer.replay.execution.wire import Job, answer_frames, recv


def serve(answer_fd: int) -> int:
    answers = os.fdopen(answer_fd, "wb")
    jobs = sys.stdin.buffer
    # vLLM's own logger follows the level the parent's command line chose.
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level:
        logging.getLogger("vllm").setLevel(level.upper())
    engine = recv(jobs)
    try:
        import_ahead(engine)        # a model worker's imports, before its first job
    except Exception:  # noqa: BLE001 - the first job's build meets it again and answers it
        pass
    while True:
        job: Job | None = recv(jobs)
        if job is None:
            answers.close()
            exit_now()
        answer_frames(lambda j, progress: replay_here(
            j.trace, engine, store=j.store, recorder=j.recorder, shortcuts=j.shortcuts,
            progress=progress), job, answers)


def exit_now() -> NoReturn:
    """End the process once every answer is sent: its exit handlers run (and the
    standard streams are flushed), the interpreter's teardown does not. vLLM's
    engine shutdown unfreezes the whole heap (``EngineCore.shutdown``:
    ``gc.unfreeze()``), so that teardown walked every object vLLM's and torch's
    imports left, twice: 2-3 s of one core per engine process after its last
    replay (a cold ``run`` has one such process, ``check --recompute`` two). The
    process's exit frees its memory as the teardown would have."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
