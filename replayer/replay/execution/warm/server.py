"""The warm server process: engine parents by engine and environment, one socket.

Run by ``replayer server start`` (:mod:`.control`) as ``python -m
replayer.replay.execution.warm.server``, detached, its log in the runtime directory.
It never imports vLLM: it accepts connections on its Unix socket (only from
this user: the socket is 0600 in a 0700 directory, and each peer's uid is
checked), starts an engine parent (:mod:`.engine_parent`) for each engine
source and import-time environment a client asks for, and hands each replay
connection, with the client's stderr, to that parent, which forks the replay.
It restarts a parent whose sources changed since it started (the client's
:mod:`.fingerprint` differs) or that died, keeps at most
:data:`MAX_PARENTS` (the least recently used goes), and exits by itself after
its idle timeout.

Requests (the first frame on a connection, a dict with ``protocol`` and
``op``): ``ping``, ``status``, ``stop``, ``warm`` (start an engine parent and
wait for it) and ``replay`` (answered by ``note`` frames, then ``refused`` or
the fork's own frames).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayer.replay.execution.warm import paths
from replayer.replay.execution.warm.fingerprint import changed_parts
from replayer.replay.execution.warm.protocol import DEFAULT_IDLE_TIMEOUT_S, PROTOCOL
from replayer.replay.execution.wire import decode, encode

MAX_PARENTS = 6
START_TIMEOUT_S = 900               # an engine parent's imports and warm-up replays
MAX_HELLO = 64 << 20


@dataclass
class ParentHandle:
    """One engine parent process, as the server sees it."""

    key: tuple
    engine: Any
    fingerprint: dict[str, str]
    proc: subprocess.Popen
    ctrl: socket.socket
    overlay: str
    info: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    replays: int = 0
    failed: int = 0
    running: set = field(default_factory=set)
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def label(self) -> str:
        return self.engine.info.label

    def alive(self) -> bool:
        return self.proc.poll() is None

    def begin_stop(self) -> None:
        """Tell the parent to finish its replays and exit. A shutdown, not a bare
        close: the server's listening thread sits in recv on this socket, and a
        close alone neither wakes it nor ends the parent's stream (the parent
        then waited out the 10 s of :meth:`stop`: every ``server stop`` took 13 s)."""
        try:
            self.ctrl.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> None:
        self.begin_stop()
        try:
            self.ctrl.close()                       # the parent lets its children finish
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self.overlay, ignore_errors=True)


class Server:
    def __init__(self, sock: socket.socket, idle_timeout: float, limits: dict[str, Any]) -> None:
        self.sock = sock
        self.idle_timeout = idle_timeout
        self.limits = limits
        self.parents: dict[tuple, ParentHandle] = {}
        self.lock = threading.Lock()
        self.key_locks: dict[tuple, threading.Lock] = {}
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.started_at = time.time()
        self.served = 0
        # Written to by stop(): wakes the accept loop at once, not at its next tick.
        self._wake_r, self._wake_w = socket.socketpair()

    # -- the accept loop ----------------------------------------------------------------

    def serve(self) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([self.sock, self._wake_r], [], [], 1.0)
            # Checked on every pass, not only when a second goes by without a
            # connection: status asked more often than that (a monitor, a test's
            # poll) is not using the server and must not keep it up.
            self._check_idle()
            if not ready or self.stopping.is_set():
                continue
            if self.sock not in ready:
                continue                            # woken by stop()
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        self._shutdown()

    def stop(self) -> None:
        self.stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _check_idle(self) -> None:
        with self.lock:
            busy = any(p.running for p in self.parents.values())
        if busy:
            self.last_activity = time.monotonic()
        elif time.monotonic() - self.last_activity > self.idle_timeout:
            log(f"idle for {self.idle_timeout:g} s: stopping")
            self.stop()

    def _shutdown(self) -> None:
        try:
            os.unlink(paths.server_socket())
        except OSError:
            pass
        with self.lock:
            parents, self.parents = list(self.parents.values()), {}
        for p in parents:                           # all told at once, then waited for
            p.begin_stop()
        for p in parents:
            p.stop()
        log("stopped")

    # -- one connection ------------------------------------------------------------------

    def _handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            if not _same_user(conn):
                return
            request, fds = _read_hello(conn)
            if request is None:
                return
            if request.get("protocol") != PROTOCOL:
                _reply(conn, ("refused", f"the running server speaks protocol {PROTOCOL}, this "
                                         f"replayer {request.get('protocol')}: restart it "
                                         "(replayer server stop; replayer server start)"))
                return
            op = request.get("op")
            if op in ("replay", "warm"):                # asking for status is not using it
                self.last_activity = time.monotonic()
            if op == "ping":
                _reply(conn, ("pong", {"pid": os.getpid(), "protocol": PROTOCOL}))
            elif op == "status":
                _reply(conn, ("status", self.status()))
            elif op == "stop":
                _reply(conn, ("stopping", os.getpid()))
                self.stop()
            elif op == "warm":
                handle = self._parent_for(request, conn)
                if handle is not None:
                    _reply(conn, ("warm", self._describe(handle)))
            elif op == "replay":
                handle = self._parent_for(request, conn)
                if handle is not None and len(fds) == 1:
                    self._hand_over(handle, request, conn, fds[0])
            else:
                _reply(conn, ("refused", f"unknown request {op!r}"))
        except Exception as exc:  # noqa: BLE001 - one client's trouble never stops the server
            log(f"request failed: {type(exc).__name__}: {exc}")
            try:
                _reply(conn, ("refused", f"the server failed: {type(exc).__name__}: {exc}"))
            except OSError:
                pass
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            conn.close()

    def _hand_over(self, handle: ParentHandle, request: dict[str, Any], conn: socket.socket,
                   err_fd: int) -> None:
        child_request = {"op": "replay", "env": request["env"], "cwd": request["cwd"]}
        # From here the engine parent holds the connection: the client waits for
        # its fork as long as the line ahead takes (the parent gone means EOF).
        _reply(conn, ("queued", handle.proc.pid))
        with handle.send_lock:
            socket.send_fds(handle.ctrl, [encode(child_request)], [conn.fileno(), err_fd])
        handle.last_used = time.monotonic()
        self.served += 1

    # -- engine parents -----------------------------------------------------------------

    def _parent_for(self, request: dict[str, Any], conn: socket.socket) -> ParentHandle | None:
        engine = request["engine"]
        key = parent_key(engine, request["env_key"])
        with self.lock:
            key_lock = self.key_locks.setdefault(key, threading.Lock())
        if not key_lock.acquire(blocking=False):
            # Another connection is starting (or restarting) this engine: say
            # so before waiting behind it, or the client gives up after its
            # first-answer timeout and replays cold from then on.
            _reply(conn, ("wait", f"waiting for warm engine {engine.info.label}"))
            key_lock.acquire()
        try:
            return self._parent_for_locked(key, engine, request, conn)
        finally:
            key_lock.release()

    def _parent_for_locked(self, key: tuple, engine: Any, request: dict[str, Any],
                           conn: socket.socket) -> ParentHandle | None:
        with self.lock:
            handle = self.parents.get(key)
        if handle is not None and not handle.alive():
            _reply(conn, ("note", f"warm engine {handle.label} had exited; restarting it"))
            self._drop(handle)
            handle = None
        if handle is not None and handle.fingerprint != request["fingerprint"]:
            what = " and ".join(changed_parts(handle.fingerprint, request["fingerprint"]))
            _reply(conn, ("note", f"warm engine {handle.label} is stale ({what} changed "
                                  "since it started); restarting it"))
            self._drop(handle)
            handle = None
        if handle is None:
            # Not said to the user (the replay takes as long as a cold one,
            # once); the client waits longer from here.
            _reply(conn, ("wait", f"starting warm engine {engine.info.label}"))
            handle, why = self._start_parent(key, engine, request)
            if handle is None:
                _reply(conn, ("refused", why))
                return None
        handle.last_used = time.monotonic()
        return handle

    def _drop(self, handle: ParentHandle) -> None:
        with self.lock:
            if self.parents.get(handle.key) is handle:
                del self.parents[handle.key]
        handle.stop()

    def _start_parent(self, key: tuple, engine: Any,
                      request: dict[str, Any]) -> tuple[ParentHandle | None, str]:
        from replayer.replay.execution.environment import engine_env, write_overlay

        self._make_room()
        overlay = tempfile.mkdtemp(prefix="replayer-warm-")
        write_overlay(engine, Path(overlay))
        server_end, parent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = engine_env(engine, Path(overlay), base=request["env"])
        log(f"starting engine parent for {engine.info.label}")
        with open(paths.server_log(), "ab") as logf:
            proc = subprocess.Popen(                # an environment's engine: its own Python
                [engine.interpreter or sys.executable,
                 "-m", "replayer.replay.execution.warm.engine_parent",
                 str(parent_end.fileno())],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                pass_fds=(parent_end.fileno(),), cwd="/")
        parent_end.close()
        handle = ParentHandle(key, engine, dict(request["fingerprint"]), proc, server_end,
                              overlay)
        server_end.sendall(encode(("engine", engine, self.limits)))
        server_end.settimeout(START_TIMEOUT_S)
        try:
            answer = decode(server_end.recv(1 << 20))
        except (OSError, struct.error, EOFError, ValueError):
            answer = ("failed", f"it exited with code {proc.poll()} while starting "
                                f"(see {paths.server_log()})")
        server_end.settimeout(None)
        if answer[0] != "ready":
            handle.stop()
            return None, f"warm engine {engine.info.label} could not start: {answer[1]}"
        handle.info = answer[1]
        log(f"engine parent for {engine.info.label} ready: {handle.info}")
        with self.lock:
            self.parents[key] = handle
        threading.Thread(target=self._listen, args=(handle,), daemon=True).start()
        return handle, ""

    def _make_room(self) -> None:
        with self.lock:
            if len(self.parents) < MAX_PARENTS:
                return
            idle = [p for p in self.parents.values() if not p.running]
            if not idle:
                return
            oldest = min(idle, key=lambda p: p.last_used)
        log(f"stopping the least recently used engine parent ({oldest.label})")
        self._drop(oldest)

    def _listen(self, handle: ParentHandle) -> None:
        """The parent's reports: a fork started, a fork done."""
        while True:
            try:
                msg = handle.ctrl.recv(1 << 16)
            except OSError:
                return
            if not msg:
                return
            kind, pid, *rest = decode(msg)
            with self.lock:
                if kind == "started":
                    handle.running.add(pid)
                elif kind == "done":
                    handle.running.discard(pid)
                    handle.replays += 1
                    if rest and rest[0]:
                        handle.failed += 1
                        log(f"replay {pid} on {handle.label}: {rest[0]}")
            self.last_activity = time.monotonic()

    def _describe(self, p: ParentHandle) -> dict[str, Any]:
        return {"engine": p.label, "pid": p.proc.pid, "env": dict(p.key[-1]),
                "started": p.started_at, "replays": p.replays, "failed": p.failed,
                "running": len(p.running), "startup_s": p.info.get("seconds"),
                "modules": p.info.get("modules")}

    def status(self) -> dict[str, Any]:
        with self.lock:
            parents = list(self.parents.values())
        return {"pid": os.getpid(), "socket": str(paths.server_socket()),
                "started": self.started_at, "idle_timeout_s": self.idle_timeout,
                "idle_s": round(time.monotonic() - self.last_activity, 1),
                "limits": self.limits, "served": self.served,
                "engines": [self._describe(p) for p in parents]}


def parent_key(engine: Any, env_key: Any) -> tuple:
    """One engine parent per engine source (the installed vLLM, a release, a tree,
    another environment's interpreter), worker and import-time environment: a
    model worker's parent imports its kernels under Triton's interpreter, which
    the null executor's never loads."""
    where = engine.sources or engine.interpreter or "installed"
    return (where, engine.worker, tuple(env_key))


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _read_hello(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The first frame and the descriptors that came with it."""
    conn.settimeout(30)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 2)
    if len(data) < 8:
        return None, fds
    size = struct.unpack_from("<Q", data)[0]
    if size > MAX_HELLO:
        return None, fds
    while len(data) < 8 + size:
        more = conn.recv(min(1 << 20, 8 + size - len(data)))
        if not more:
            return None, fds
        data += more
    conn.settimeout(None)
    return decode(data), fds


def _reply(conn: socket.socket, frame: Any) -> None:
    conn.sendall(encode(frame))


def log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replayer.replay.execution.warm.server")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S)
    p.add_argument("--replay-timeout", type=float, default=None)
    p.add_argument("--replay-memory-mb", type=int, default=None)
    args = p.parse_args(argv)
    where = paths.private_dir(paths.runtime_dir())
    lock = open(where / "server.lock", "a")
    deadline = time.monotonic() + 30                # a server still stopping lets go soon
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() > deadline:
                log("another server holds the lock: not starting")
                return 1
            time.sleep(0.1)
    path = paths.server_socket()
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(64)
    limits = {"timeout_s": args.replay_timeout, "memory_mb": args.replay_memory_mb}
    log(f"listening on {path} (pid {os.getpid()}, idle timeout {args.idle_timeout:g} s, "
        f"limits {limits})")
    Server(sock, args.idle_timeout, limits).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
