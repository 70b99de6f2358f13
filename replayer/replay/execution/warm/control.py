"""``replayer server start|status|stop``: the warm server's lifecycle, as text.

``start`` launches :mod:`.server` detached (its own session, its log in the
runtime directory), waits until it answers, then warms each engine asked
for (the installed vLLM by default) so the first replay is already warm.
Every function returns the lines to print and an exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from replayer.replay.execution.warm import paths
from replayer.replay.execution.warm.client import ServerUnavailable, request

READY_S = 30.0


def _ping() -> dict[str, Any] | None:
    try:
        frame = request("ping", timeout=5.0)
    except ServerUnavailable:
        return None
    return frame[1] if frame[0] == "pong" else None


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:g} s"


def start(engines: list[str], idle_timeout: float, replay_timeout: float | None,
          replay_memory_mb: int | None, worker: str = "null") -> tuple[list[str], int]:
    from replayer.replay.engines.sources.specs import parse_spec, resolve
    from replayer.replay.execution.environment import engine_env_defaults

    resolved = [resolve(parse_spec(e, worker)) for e in engines]    # bad: one line, first
    lines: list[str] = []
    pong = _ping()
    if pong is None:
        where = paths.private_dir(paths.runtime_dir())
        try:
            paths.server_socket().unlink()          # a server that died left it
        except FileNotFoundError:
            pass
        cmd = [sys.executable, "-m", "replayer.replay.execution.warm.server",
               "--idle-timeout", str(idle_timeout)]
        if replay_timeout:
            cmd += ["--replay-timeout", str(replay_timeout)]
        if replay_memory_mb:
            cmd += ["--replay-memory-mb", str(replay_memory_mb)]
        with open(paths.server_log(), "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, cwd=str(where),
                                    env={**engine_env_defaults(), **os.environ})
        deadline = time.monotonic() + READY_S
        while pong is None:
            if proc.poll() is not None:
                pong = _ping()                      # another start won the race to the lock
                if pong is not None and pong["pid"] != proc.pid:
                    break
                return [f"replayer: error: the server exited with code {proc.returncode} "
                        f"while starting (see {paths.server_log()})"], 2
            if time.monotonic() > deadline:
                proc.kill()
                return [f"replayer: error: the server did not answer within {READY_S:g} s "
                        f"(see {paths.server_log()})"], 2
            time.sleep(0.1)
            pong = _ping()
        started = "server started" if pong["pid"] == proc.pid else "server already running"
        lines.append(f"{started}: pid {pong['pid']}, listening on {paths.server_socket()}")
    else:
        lines.append(f"server already running: pid {pong['pid']}, listening on "
                     f"{paths.server_socket()}")
    from replayer.replay.execution.warm.client import WarmClient

    for engine in resolved:
        hello = WarmClient(engine, cold=lambda: None,
                           env_defaults=engine_env_defaults())._hello()
        hello.pop("protocol")
        hello.pop("op")
        started = time.monotonic()
        try:
            frame = request("warm", timeout=20.0, **hello)
        except ServerUnavailable as exc:
            return [*lines, f"replayer: error: warming {engine.info.label}: {exc}"], 2
        if frame[0] != "warm":
            return [*lines, f"replayer: error: {frame[1]}"], 2
        lines.append(f"warm: {engine.info.label} (engine pid {frame[1]['pid']}, ready in "
                     f"{time.monotonic() - started:.1f} s)")
    return lines, 0


def status() -> tuple[list[str], int]:
    try:
        frame = request("status", timeout=5.0)
    except ServerUnavailable:
        return [f"no server running (socket {paths.server_socket()})"], 1
    s = frame[1]
    lines = [f"server pid {s['pid']}, listening on {s['socket']}",
             f"idle timeout {_duration(s['idle_timeout_s'])} (it stops by itself after that "
             f"long unused); replays served: {s['served']}"]
    limits = s["limits"]
    if limits.get("timeout_s") or limits.get("memory_mb"):
        lines.append("limits per replay: " + ", ".join(filter(None, [
            f"{limits['timeout_s']:g} s" if limits.get("timeout_s") else "",
            f"{limits['memory_mb']} MB" if limits.get("memory_mb") else ""])))
    if not s["engines"]:
        lines.append("engines warm: none yet (the first replay on each starts it)")
    for e in s["engines"]:
        lines.append(f"warm: {e['engine']}: pid {e['pid']}, {e['replays']} replay(s) "
                     f"({e['failed']} failed), {e['running']} running, started in "
                     f"{e['startup_s']} s")
    return lines, 0


def stop() -> tuple[list[str], int]:
    try:
        frame = request("stop", timeout=5.0)
    except ServerUnavailable:
        return ["no server running"], 0
    pid = frame[1]
    deadline = time.monotonic() + 60               # its engines finish their replays first
    while time.monotonic() < deadline:
        if has_exited(pid):
            return [f"server stopped (pid {pid})"], 0
        time.sleep(0.05)
    return [f"replayer: error: the server (pid {pid}) is still stopping after 60 s"], 1


def has_exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie. A zombie has exited: it waits
    only for whoever reaps it (the init of a container may take seconds, and the
    server of a test is this process's own child)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")
