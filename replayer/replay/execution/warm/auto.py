"""``PREFIX_REPLAYER_AUTO_SERVER=1``: the warm server started on first use.

A user who has not read about ``replayer server start`` pays vLLM's import on
every command (about 9 s here). With this variable set, the first command
that would replay cold starts the server instead (lazy: no engine warmed
ahead), one line on stderr says so, and that command's replay is the first
on the new server (as long as a cold one, once); every later command finds
it warm. The server stops by itself after its idle timeout (4 h), or with
``replayer server stop``. A server that cannot start means a cold replay and
one line, never a failed command.
"""

from __future__ import annotations

import os
import sys
import threading

AUTO_ENV = "PREFIX_REPLAYER_AUTO_SERVER"

_lock = threading.Lock()
_tried = False                  # once per process, whatever the outcome


def wanted() -> bool:
    return os.environ.get(AUTO_ENV, "") not in ("", "0")


def start_if_wanted() -> bool:
    """Start the server when :data:`AUTO_ENV` asks for it and none answers; True
    when one runs afterwards. Tried once per process (replays from several
    threads, as ``explain`` runs them, start one server)."""
    global _tried
    if not wanted():
        return False
    with _lock:
        if _tried:
            from replayer.replay.execution.warm import paths

            return paths.server_socket().exists()
        _tried = True
        from replayer.replay.execution.warm.control import start
        from replayer.replay.execution.warm.protocol import DEFAULT_IDLE_TIMEOUT_S

        try:
            lines, code = start([], DEFAULT_IDLE_TIMEOUT_S, None, None)
        except Exception as exc:  # noqa: BLE001 - never fail the command for it
            lines, code = [f"{type(exc).__name__}: {exc}"], 2
        if code != 0:
            why = lines[-1].removeprefix("replayer: error: ") if lines else "unknown"
            print(f"replayer: {AUTO_ENV}=1, but the warm server did not start ({why}); "
                  "replaying cold", file=sys.stderr, flush=True)
            return False
        if lines and lines[0].startswith("server started"):
            print(f"replayer: {lines[0]} ({AUTO_ENV}=1; `replayer server stop` stops it): "
                  "this command starts its engine, later ones replay warm",
                  file=sys.stderr, flush=True)
        return True
