"""The warm server: byte-identical to cold, side by side, limits, privacy, staleness.

Each test module's server lives in a private runtime directory of its own
(``PREFIX_REPLAYER_RUNTIME_DIR``), so these tests never touch the suite's
shared server or a user's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SCENARIOS, STORE_SCENARIOS, TRACES, cli

pytestmark = pytest.mark.slow

TURNS = SCENARIOS / "vllm51295_turn1_24577.yaml"
RESEND = STORE_SCENARIOS / "resend_after_reset.yaml"
CONVERSATION = TRACES / "conversation_500"


def _runtime_dir() -> Path:
    # Short: a Unix socket's path is at most 107 bytes.
    return Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))


class Server:
    """A server of the test's own: ``env`` reaches it and its clients."""

    def __init__(self, *options: str) -> None:
        self.root = _runtime_dir()
        self.env = {"PREFIX_REPLAYER_RUNTIME_DIR": str(self.root),
                    "PREFIX_REPLAYER_NO_SERVER": ""}
        proc = self.cli("server", "start", *options)
        assert proc.returncode == 0, proc.stderr
        self.start_output = proc.stdout

    def cli(self, *args: object, env: dict[str, str] | None = None, **kw):
        return cli(*args, env={**self.env, **(env or {})}, **kw)

    def status(self) -> str:
        return self.cli("server", "status").stdout

    def stop(self) -> None:
        self.cli("server", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def _json(server_or_none, target: Path, tmp: Path, name: str, seed: str,
          *extra: str) -> bytes:
    out = tmp / f"{name}.json"
    env = {"PYTHONHASHSEED": seed}
    if server_or_none is None:
        proc = cli("run", target, "--json", out, *extra,
                   env={**env, "PREFIX_REPLAYER_NO_SERVER": "1"})
    else:
        proc = server_or_none.cli("run", target, "--json", out, *extra, env=env)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


def test_start_says_where_it_listens_and_status_lists_the_warm_engine(server):
    assert f"listening on {server.root}" in server.start_output
    assert "warm: vllm" in server.start_output and "(installed)" in server.start_output
    status = server.status()
    assert "idle timeout 4 h" in status
    assert "warm: vllm" in status and "(installed): pid" in status


def test_warm_is_byte_identical_to_cold_whatever_the_shell_seed_and_after_every_scenario(
        server, tmp_path, monkeypatch):
    cold = _json(None, RESEND, tmp_path, "cold", "123")
    warm = _json(server, RESEND, tmp_path, "warm", "7")
    assert warm == cold
    # Every scenario once (a repeat replays the same fork of the same engine: it
    # showed nothing more), and five on a second engine, in the same server ...
    from traces import load_target

    from replayer.replay.engines import UnsupportedByEngine
    from replayer.replay.execution.clients import make_client

    others = [load_target(p) for p in sorted(SCENARIOS.glob("*.yaml"))]
    # This module's server, for this test only (monkeypatch puts back the suite's
    # own runtime directory: the tests that run after it in this worker use it).
    monkeypatch.setenv("PREFIX_REPLAYER_RUNTIME_DIR", str(server.root))
    try:
        client = make_client("installed", own_process=True)
        assert type(client).__name__ == "WarmClient"
        assert len(client.replay_many(others)) == len(others) >= 20
        old = make_client("vllm==0.29.0", own_process=True)
        done = 0
        for trace in others:
            if done == 5:
                break
            try:
                old(trace)
                done += 1
            except UnsupportedByEngine:
                continue
        assert done == 5
        assert client.warm_replays == len(others) and client.cold_replays == 0
    finally:
        monkeypatch.undo()
    # ... and the same fixture again, from a third seed: still identical.
    assert _json(server, RESEND, tmp_path, "again", "99") == cold
    assert "vllm 0.29.0 (release)" in server.status()


def test_two_clients_at_once_each_get_their_own_result(server, tmp_path):
    alone = {t: _json(server, t, tmp_path, t.stem + "_alone", "0") for t in (TURNS, RESEND)}
    procs = {}
    for t in (TURNS, RESEND):
        out = tmp_path / f"{t.stem}_together.json"
        procs[t] = (out, subprocess.Popen(
            [sys.executable, "-m", "replayer", "run", str(t), "--json", str(out)],
            cwd=REPO, env={**os.environ, **server.env}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
    for t, (out, proc) in procs.items():
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
        assert out.read_bytes() == alone[t]


def test_each_replay_takes_its_own_clients_tmpdir(server, tmp_path):
    """An engine parent is started with the environment of the first client that
    asks for it; a later client's replay must not put its temporary files (a store
    replay's sockets) where that first client's TMPDIR was, which may be gone."""
    target = REPO / "fixtures" / "store" / "shared_prefix_junction.yaml"
    first = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))   # short: sockets live there
    # An import-time variable of its own: a new engine parent, started by this client.
    key = {"VLLM_REPLAYER_TEST_TMPDIR_KEY": tmp_path.name}
    proc = server.cli("run", target, env={**key, "TMPDIR": str(first)})
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(first)
    proc = server.cli("run", target, env=key)
    assert proc.returncode == 0, proc.stderr


def test_a_client_killed_mid_replay_leaves_the_server_serving(server, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "replayer", "run", str(CONVERSATION)],
                            cwd=REPO, env={**os.environ, **server.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while "1 running" not in server.status():
        assert time.monotonic() < deadline, "the replay never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while "0 running" not in server.status():       # the fork ends on its broken pipe
        assert time.monotonic() < deadline, server.status()
        time.sleep(0.2)
    after = server.cli("check", TURNS)
    assert after.returncode == 0 and after.stdout.startswith("PASS"), after.stderr


def test_a_replay_past_its_limits_is_killed_and_reported_and_the_server_goes_on():
    s = Server("--replay-timeout", "0.5", "--replay-memory", "100000")
    try:
        slow = s.cli("run", CONVERSATION)
        assert slow.returncode == 2
        assert slow.stderr.strip().endswith(
            "the warm replay was killed: past its time limit of 0.5 s"), slow.stderr
        assert "limits per replay: 0.5 s, 100000 MB" in s.status()
        ok = s.cli("check", TURNS)
        assert ok.returncode == 0, ok.stderr
    finally:
        s.stop()
    s = Server("--replay-memory", "50")
    try:
        big = s.cli("run", CONVERSATION)
        assert big.returncode == 2
        assert "the warm replay was killed: past its memory limit of 50 MB" in big.stderr
        assert "1 replay(s) (1 failed)" in s.status()
        # A server with a warm engine stops within 2 s, interpreter start included
        # (it took 13 s: the engine parent never saw its control socket close).
        started = time.monotonic()
        stop = s.cli("server", "stop")
        took = time.monotonic() - started
        assert stop.returncode == 0 and stop.stdout.startswith("server stopped"), stop
        assert took < 2.0, f"server stop took {took:.1f} s"
        assert "no server running" in s.status()
    finally:
        s.stop()


def test_the_socket_is_the_users_own(server):
    sock = next(server.root.glob("env-*/server.sock"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(server.root.stat().st_mode) == 0o700
    if os.getuid() != 0:
        return                                      # only root can play another user here
    pid = os.fork()
    if pid == 0:                                    # another user: 'nobody'
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(sock))
                code = 1                            # connected: a failure
            except PermissionError:
                code = 0
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "another user could connect"


def test_a_stale_engine_is_restarted_and_said_in_one_line(server, monkeypatch, capfd):
    from traces import load_target

    from replayer.replay.execution.clients import make_client
    from replayer.replay.execution.warm import client as warm_client

    monkeypatch.setenv("PREFIX_REPLAYER_RUNTIME_DIR", str(server.root))
    client = make_client("installed", own_process=True)
    client(load_target(TURNS))          # this environment's engine is warm, whatever ran before
    capfd.readouterr()
    real = warm_client.engine_fingerprint
    monkeypatch.setattr(warm_client, "engine_fingerprint",
                        lambda engine: {**real(engine), "vllm": "changed"})
    result = client(load_target(TURNS))
    assert result.by_id()["turn2"].num_cached_tokens == 24448
    err = capfd.readouterr().err.splitlines()
    assert err == ["replayer: warm engine vllm 0.33.0 (installed) is stale (vLLM changed "
                   "since it started); restarting it"], err
    monkeypatch.setattr(warm_client, "engine_fingerprint", real)
    client(load_target(TURNS))                      # and back: restarted once more, said
    assert "is stale" in capfd.readouterr().err


def test_a_server_that_cannot_answer_means_a_cold_replay_with_one_line(tmp_path):
    root = _runtime_dir()
    try:
        env = {"PREFIX_REPLAYER_RUNTIME_DIR": str(root), "PREFIX_REPLAYER_NO_SERVER": ""}
        os.environ.update(env)
        try:
            from replayer.replay.execution.warm import paths

            where = paths.private_dir(paths.runtime_dir())
            dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            dead.bind(str(where / "server.sock"))   # bound, never listening: refused
            dead.close()
        finally:
            for k in env:
                del os.environ[k]
        proc = cli("check", TURNS, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("PASS")
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("replayer: warm server unavailable (")
        assert lines[0].endswith("); replaying cold")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_no_server_opts_out(server, monkeypatch):
    from replayer.replay.execution.clients import make_client

    monkeypatch.setenv("PREFIX_REPLAYER_RUNTIME_DIR", str(server.root))
    assert type(make_client("installed", own_process=True)).__name__ == "WarmClient"
    monkeypatch.setenv("PREFIX_REPLAYER_NO_SERVER", "1")
    assert type(make_client("installed", own_process=True)).__name__ == "EngineProcess"
    assert type(make_client("installed")).__name__ == "InProcessClient"


def test_idle_timeout_stops_it_by_itself(monkeypatch):
    """Status asked four times a second is not use: the server still stops after
    its idle timeout (it once checked only after a second with no connection)."""
    from replayer.replay.execution.warm.control import _ping

    s = Server("--lazy", "--idle-timeout", "2")
    try:
        assert "warm:" not in s.start_output
        assert "engines warm: none yet" in s.status()
        monkeypatch.setenv("PREFIX_REPLAYER_RUNTIME_DIR", str(s.root))
        deadline = time.monotonic() + 30
        while _ping() is not None:
            assert time.monotonic() < deadline, "still running"
            time.sleep(0.25)
        assert "no server running" in s.status()
    finally:
        s.stop()


def test_explain_in_parallel_on_the_server_equals_the_serial_cold_run(server, tmp_path):
    cold, warm = tmp_path / "cold.json", tmp_path / "warm.json"
    c = cli("explain", RESEND, "--json", cold, env={"PREFIX_REPLAYER_NO_SERVER": "1"})
    w = server.cli("explain", RESEND, "--json", warm)
    assert c.returncode == 0 and w.returncode == 0, (c.stderr, w.stderr)
    assert c.stdout == w.stdout
    assert json.loads(cold.read_text()) == json.loads(warm.read_text())
    assert cold.read_bytes() == warm.read_bytes()


def test_server_options_are_checked():
    proc = cli("server", "status", "--idle-timeout", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "replayer: error: server status takes no options"
    proc = cli("server", "start", "--idle-timeout", "0")
    assert proc.returncode == 2 and "must be positive" in proc.stderr


def test_auto_server_starts_one_on_first_use_and_says_so_once():
    """PREFIX_REPLAYER_AUTO_SERVER=1: the first client that finds no server starts
    one (lazy: no engine ahead), says so in one line, and later ones find it."""
    root = _runtime_dir()
    env = {**os.environ, "PREFIX_REPLAYER_RUNTIME_DIR": str(root),
           "PREFIX_REPLAYER_NO_SERVER": "", "PREFIX_REPLAYER_AUTO_SERVER": "1"}
    code = ("from replayer.replay.execution.clients import warm_server_running\n"
            "print(warm_server_running(), warm_server_running())\n")
    try:
        first = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=120)
        assert (first.returncode, first.stdout) == (0, "True True\n"), first
        said = first.stderr.splitlines()
        assert len(said) == 1 and said[0].startswith("replayer: server started: pid "), said
        assert said[0].endswith("(PREFIX_REPLAYER_AUTO_SERVER=1; `replayer server stop` stops "
                                "it): this command starts its engine, later ones replay warm")
        again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=120)
        assert (again.stdout, again.stderr) == ("True True\n", "")    # found, not started
        status = cli("server", "status", env=env)
        assert "engines warm: none yet" in status.stdout, status
        off = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, timeout=120,
                             capture_output=True, env={**env, "PREFIX_REPLAYER_AUTO_SERVER": "",
                                                       "PREFIX_REPLAYER_RUNTIME_DIR": str(root / "x")})
        assert (off.stdout, off.stderr) == ("False False\n", "")     # not asked: none started
    finally:
        cli("server", "stop", env=env)
        shutil.rmtree(root, ignore_errors=True)


def test_a_slow_cold_start_names_the_warm_server_once_to_a_person(tmp_path, monkeypatch):
    import io

    from replayer.cli.hints import warm_server_hint

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(tmp_path))
    monkeypatch.delenv("PREFIX_REPLAYER_NO_SERVER", raising=False)
    monkeypatch.delenv("PREFIX_REPLAYER_AUTO_SERVER", raising=False)
    assert not warm_server_hint([0.4, 1.2], Terminal())          # quick: nothing to say
    assert not warm_server_hint([9.1], io.StringIO())            # not a person: a pipe
    monkeypatch.setenv("PREFIX_REPLAYER_NO_SERVER", "1")
    assert not warm_server_hint([9.1], Terminal())               # cold on purpose
    monkeypatch.delenv("PREFIX_REPLAYER_NO_SERVER")
    term = Terminal()
    assert warm_server_hint([0.3, 9.1], term)
    assert term.getvalue() == (
        "replayer: hint: 9 s of this command went to starting vLLM. `replayer server start` "
        "keeps it imported, so later commands replay in under a second; "
        "PREFIX_REPLAYER_AUTO_SERVER=1 starts it on first use (docs/warm-engines.md). "
        "Said once.\n")
    assert not warm_server_hint([9.1], Terminal())               # once
