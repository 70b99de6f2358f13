"""The child side of :mod:`replayer.engine_process`: replays jobs on the vLLM it imports.

Started as ``python -m replayer.engine_child FD`` with a release's or a
tree's sources first on ``sys.path``; reads the engine, then one job per
replay, from stdin, replays each with :func:`replayer.runner.replay_here` and
answers on ``FD`` (progress, result, or the error the parent raises again).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from traces import TraceError

from .engine_process import Job, recv, send
from .engines import EngineError
from .replay import ReplayError
from .runner import replay_here


def serve(answer_fd: int) -> int:
    answers = os.fdopen(answer_fd, "wb")
    jobs = sys.stdin.buffer
    # vLLM's own logger follows the level the parent's command line chose.
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level:
        logging.getLogger("vllm").setLevel(level.upper())
    engine = recv(jobs)
    bad_input: tuple[type[BaseException], ...] = (TraceError, EngineError, ReplayError)
    try:
        from .store import StoreError

        bad_input += (StoreError,)
    except ImportError:  # pragma: no cover - the store package is optional here
        pass
    while True:
        job: Job | None = recv(jobs)
        if job is None:
            return 0
        try:
            result = replay_here(job.trace, engine, store=job.store, record_dir=job.record_dir,
                                 shortcuts=job.shortcuts,
                                 progress=lambda p: send(answers, ("progress", p)))
            send(answers, ("result", result))
        except bad_input as exc:
            send(answers, ("error", type(exc).__name__, str(exc)))
        except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
            send(answers, ("crash", traceback.format_exc()))


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
