"""The recorder's checks at server start, before the model loads.

vLLM runs every ``vllm.general_plugins`` entry point early in each of its
processes: the API server while it reads its arguments, then the engine core
and each worker as they start. The recording scheduler itself is built only
after the model has loaded and the KV cache was sized (tens of seconds, about
a hundred lines of log), so a recording that cannot start would otherwise be
refused there, inside a traceback. This entry point (``pyproject.toml``)
refuses it first, in one line on vLLM's logger, and the server exits 1:

* the directory ``PREFIX_REPLAYER_RECORD_DIR`` names is not new and empty,
  or cannot be written;
* the running vLLM lacks a name the hooks use (:mod:`.hooks`).

A server that does not record (the variable unset) pays an environment
lookup. A directory named only by the connector's ``recorder_dir`` is checked
when the connector starts, as before.
"""

from __future__ import annotations

import os

RECORD_ENV = "PREFIX_REPLAYER_RECORD_DIR"      # = releases.RECORD_ENV, without importing it


def check_recording_can_start() -> None:
    """Refuse (exit 1, one line) a recording that cannot start; else nothing."""
    out = os.environ.get(RECORD_ENV)
    if not out:
        return
    from replayer.recorder.releases import log

    try:
        problem = recording_problem(out)
    except Exception as exc:  # noqa: BLE001 - a check that cannot run must not pass
        problem = f"prefix-replayer recorder: {out}: cannot check the recording ({exc})"
    if problem is not None:
        _vllm_logging_on()
        log.error("%s", problem)
        raise SystemExit(1)


def _vllm_logging_on() -> None:
    """vLLM's own log format on its logger tree. From 0.31 ``vllm serve`` applies
    it only after parsing its arguments, and plugins load before (while the
    parser is built), so the line would go out bare: apply vLLM's default
    configuration, as 0.29-0.30 do at import (the CLI's own replaces it later)."""
    import logging

    if logging.getLogger("vllm").handlers:
        return
    try:
        from vllm.logger import _configure_vllm_root_logger

        _configure_vllm_root_logger()
    except Exception:  # noqa: BLE001 - the line still goes out, unformatted
        pass


def recording_problem(out: str) -> str | None:
    """Why recording into ``out`` cannot start, in one line; None when it can."""
    import tempfile
    from pathlib import Path

    import vllm

    from replayer.recorder.releases import check_release
    from replayer.recorder.session import check_new_recording
    from traces.io.parts import RecordingError

    path = Path(out)
    try:
        check_new_recording(path)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except RecordingError as exc:
        return f"prefix-replayer recorder: {exc}"
    except OSError as exc:
        return (f"prefix-replayer recorder: {exc.filename or path}: cannot record here "
                f"({exc.strerror or exc})")
    try:
        check_release(vllm.__version__)
    except RuntimeError as exc:
        return str(exc)
    return None
