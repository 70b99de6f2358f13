"""An engine parent: vLLM imported once, then only forks, one child per replay.

Started by the warm server (:mod:`.server`) as ``python -m
replayer.replay.execution.warm.engine_parent FD`` in the environment an engine
process gets (:func:`replayer.replay.execution.environment.engine_env`: the
pinned interpreter hash seed, a release's or tree's sources first on
``sys.path``). On ``FD``, a SOCK_SEQPACKET socket to the server, it reads
its engine, imports everything a replay imports (:func:`preload`), says it
is ready, then for every ``replay`` message (with the client's connection
and stderr as passed descriptors) forks a child that runs the replay and
answers the client itself.

Why a fork per replay: the parent itself never builds an engine or
replays, so every child starts from the same pristine state a cold process
reaches after its imports; nothing one replay leaves behind (vLLM's module
caches, the hash seed, the store) reaches the next. Children run side by
side, at most one per core; the rest wait in line. A child past its time
or memory limit is killed and its client told why; the parent goes on.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayer.replay.execution.wire import decode, encode

# A child's memory is read from /proc this often, and its deadline checked.
POLL_S = 0.2
MAX_MESSAGE = 1 << 20

# Small scenarios whose replays import what real ones do (the adapter, EAGLE,
# Mamba, the store connector, KV events): run once in a throw-away fork, whose
# module list the parent then imports (:func:`preload`).
WARM_UP_SCENARIOS = {
    "hybrid_eagle.yaml": """
engine:
  block_size: 64
  prefix_match_unit: 16
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  speculative: {method: eagle, num_speculative_tokens: 1, disable_lookahead_block_hashes: true}
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 64
requests:
  - {id: a, prompt: [{stream: d, len: 200}], output_len: 2}
  - {id: b, after: a, prompt: [{stream: d, len: 300}], output_len: 2}
""",
    "store.yaml": """
engine:
  block_size: 64
  prefix_match_unit: 16
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 64
  connector: mooncake_store
requests:
  - {id: a, prompt: [{stream: d, len: 200}]}
  - {id: b, after: a, prompt: [{stream: d, len: 200}]}
events:
  - {after: a, action: reset_prefix_cache}
""",
    "sliding_window.yaml": """
engine:
  block_size: 16
  kv_groups: [{kind: full_attention}, {kind: sliding_window, sliding_window: 32}]
  max_num_batched_tokens: 256
  max_num_seqs: 4
  num_gpu_blocks: 64
requests:
  - {id: a, prompt: [{stream: d, len: 100}], output_len: 2}
  - {id: b, after: a, prompt: [{stream: d, len: 120}], output_len: 2}
""",
}

# The model worker's (``--worker model``): a Llama at block 16 (the vec16 path)
# with a store, and a gated-DeltaNet hybrid with EAGLE (the Mamba-copy kernels
# under Triton's interpreter). Tiny prompts: the probe imports what such replays
# import (a sliding window's Llama imports nothing more), in seconds.
MODEL_WARM_UP_SCENARIOS = {
    "hybrid_eagle.yaml": """
engine:
  block_size: 256
  prefix_match_unit: 32
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  speculative: {method: eagle, num_speculative_tokens: 1, disable_lookahead_block_hashes: true}
  max_num_batched_tokens: 512
  max_num_seqs: 4
  num_gpu_blocks: 16
requests:
  - {id: a, prompt: [{stream: d, len: 300}], output_len: 2}
  - {id: b, after: a, prompt: [{stream: d, len: 600}], output_len: 2}
""",
    "store.yaml": """
engine:
  block_size: 16
  kv_groups: [{kind: full_attention}]
  max_num_batched_tokens: 256
  max_num_seqs: 4
  num_gpu_blocks: 64
  connector: mooncake_store
requests:
  - {id: a, prompt: [{stream: d, len: 100}], output_len: 2}
  - {id: b, after: a, prompt: [{stream: d, len: 100}], output_len: 2}
events:
  - {after: a, action: reset_prefix_cache}
""",
}


def warm_up_scenarios(engine: Any) -> dict[str, str]:
    """The probe's scenarios for ``engine``'s worker."""
    return MODEL_WARM_UP_SCENARIOS if engine.worker == "model" else WARM_UP_SCENARIOS


def preload(engine: Any) -> dict[str, Any]:
    """Import what a replay on ``engine`` imports; freeze the heap; say what was done."""
    start = time.perf_counter()
    from replayer.replay.engines import adapter_module_for
    from replayer.replay.execution import in_process  # noqa: F401 - the replay loop, the engines package

    __import__(adapter_module_for(engine.info.vllm))
    import vllm  # noqa: F401

    missing = _modules_a_replay_imports(engine)
    imported = 0
    for name in missing:
        if name in sys.modules:
            continue
        try:
            __import__(name)
            imported += 1
        except BaseException:  # noqa: BLE001 - a child imports it itself if it needs it
            pass
    # Everything imported so far survives every replay: out of the collector's
    # sight, so no child walks (and copies) it.
    gc.collect()
    gc.freeze()
    info = {"pid": os.getpid(), "modules": len(sys.modules), "imported_after_probe": imported,
            "seconds": round(time.perf_counter() - start, 2)}
    if engine.worker == "model":
        info["torch_threads"] = _cold_torch_threads()
    return info


def _cold_torch_threads() -> int:
    """The intra-op threads a cold engine process starts with (OMP_NUM_THREADS, else
    the cores it may run on): read, never set, in this parent, which runs no torch
    op (a fork of a process whose OpenMP pool had started could hang in its first
    parallel region); each fork sets it before its engine is built."""
    import torch

    return torch.get_num_threads()


def _modules_a_replay_imports(engine: Any) -> list[str]:
    """Module names a throw-away fork ends with after the warm-up replays."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                    # the probe: never returns
        code = 0
        try:
            os.close(read_fd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            _warm_up(engine)
            os.write(write_fd, "\n".join(sorted(sys.modules)).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as fh:
        chunks.append(fh.read())
    os.waitpid(pid, 0)
    return [m for m in b"".join(chunks).decode().splitlines() if m]


def _warm_up(engine: Any) -> None:
    from replayer.replay.execution.in_process import replay_here
    from replayer.replay.store import parse_store_spec
    from traces.scenarios.compile import compile_scenario

    with tempfile.TemporaryDirectory(prefix="replayer-warm-up-") as tmp:
        for name, text in warm_up_scenarios(engine).items():
            path = Path(tmp) / name
            path.write_text(text)
            try:
                replay_here(compile_scenario(path), engine, store=parse_store_spec("memory"))
            except Exception:  # noqa: BLE001 - an engine without this feature: skip it
                pass


@dataclass
class Child:
    pid: int
    conn: socket.socket
    started: float
    deadline: float | None
    memory_limit: int | None
    killed_for: str | None = None


@dataclass
class Parent:
    """The fork loop (see the module's docstring)."""

    ctrl: socket.socket
    engine: Any
    limits: dict[str, Any]
    max_parallel: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    torch_threads: int | None = None                # a model worker's (see _cold_torch_threads)
    waiting: deque = field(default_factory=deque)
    children: dict[int, Child] = field(default_factory=dict)

    def run(self) -> int:
        while True:
            if self.waiting and len(self.children) < self.max_parallel:
                self._fork(*self.waiting.popleft())
                continue
            ready, _, _ = select.select([self.ctrl], [], [], POLL_S)
            if ready:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(self.ctrl, MAX_MESSAGE, 4)
                except OSError:
                    msg, fds = b"", []
                if not msg:                         # the server is gone: finish, then leave
                    for fd in fds:
                        os.close(fd)
                    self._drain()
                    return 0
                self._take(msg, fds)
            self._reap()
            self._enforce_limits()

    def _take(self, msg: bytes, fds: list[int]) -> None:
        request = decode(msg)
        if request.get("op") != "replay" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return
        self.waiting.append((request, fds[0], fds[1]))

    def _fork(self, request: dict[str, Any], conn_fd: int, err_fd: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child_main(self.engine, request, conn_fd, err_fd, self.ctrl,   # never returns
                        self.torch_threads)
        os.close(err_fd)
        conn = socket.socket(fileno=conn_fd)
        now = time.monotonic()
        timeout = self.limits.get("timeout_s")
        memory = self.limits.get("memory_mb")
        self.children[pid] = Child(pid, conn, now, now + timeout if timeout else None,
                                   memory * (1 << 20) if memory else None)
        self._tell_server(("started", pid))

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            reason = child.killed_for
            if reason is None and status != 0:
                reason = _exit_words(status)
            if reason is not None:                  # the client hears why it got no answer
                try:
                    child.conn.sendall(encode(("lost", reason)))
                except OSError:
                    pass
            child.conn.close()
            self._tell_server(("done", pid, reason))

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            if child.killed_for:
                continue
            why = None
            if child.deadline is not None and now > child.deadline:
                why = f"was killed: past its time limit of {self.limits['timeout_s']:g} s"
            elif child.memory_limit is not None:
                own = private_bytes(child.pid)
                if own is not None and own > child.memory_limit:
                    why = (f"was killed: past its memory limit of {self.limits['memory_mb']} MB "
                           f"({own >> 20} MB of its own)")
            if why:
                child.killed_for = why
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _drain(self) -> None:
        while self.children:
            self._reap()
            self._enforce_limits()
            time.sleep(POLL_S)

    def _tell_server(self, msg: Any) -> None:
        try:
            self.ctrl.send(encode(msg))
        except OSError:
            pass


def _exit_words(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with code {os.WEXITSTATUS(status)} before answering"


def private_bytes(pid: int) -> int | None:
    """Memory a child holds of its own (not shared with the parent), from /proc."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def _child_main(engine: Any, request: dict[str, Any], conn_fd: int, err_fd: int,
                ctrl: socket.socket, threads: int | None = None) -> None:
    """One replay in a fresh fork; answers the client on its own connection."""
    code = 0
    try:
        ctrl.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(err_fd, 1)                          # vLLM's prints reach the client's stderr
        os.dup2(err_fd, 2)
        os.close(err_fd)
        os.chdir(request["cwd"])
        # The client's environment, but for what makes this process the engine
        # it is: a release's overlay first on PYTHONPATH, the pinned seed and
        # its own vLLM cache root (environment.engine_env). (vLLM runs
        # subprocesses, e.g. to inspect a model class; without the overlay they
        # would import the installed vLLM, not this release.)
        # A model worker's parent also runs Triton's interpreter (TRITON_INTERPRET,
        # read again when the Mamba-copy kernels are wrapped in the fork).
        own = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONHASHSEED", "VLLM_CACHE_ROOT",
                                          "TRITON_INTERPRET") if k in os.environ}
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(own)
        # Temporary files where this client's TMPDIR says, not where the client
        # that started this engine parent said (tempfile caches its directory:
        # a store replay's sockets live there, and that client's may be gone).
        tempfile.tempdir = None
        conn = socket.socket(fileno=conn_fd)
        stream = conn.makefile("rwb")
        from replayer.replay.execution.in_process import replay_here
        from replayer.replay.execution.wire import answer_frames, recv, send

        if threads:                                 # torch after a fork: as a cold process
            import torch

            torch._C.set_num_threads(threads)
        send(stream, ("ready", os.getpid()))
        job = recv(stream)
        if job is not None:
            with _no_collections_at_teardown():
                answer_frames(lambda j, progress: replay_here(
                    j.trace, engine, store=j.store, recorder=j.recorder,
                    shortcuts=j.shortcuts, progress=progress), job, stream)
        stream.flush()
    except BaseException:  # noqa: BLE001 - the client is gone, or a bug: exit all the same
        code = 3
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _no_collections_at_teardown:
    """vLLM's engine shutdown unfreezes the heap and runs full collections
    (~0.6 s over the whole pre-imported heap). In a fork that exits right after
    the replay they free nothing anyone uses; automatic collections still run,
    and nothing reference counting frees changes, so no outcome can change."""

    def __enter__(self) -> None:
        self._saved = gc.collect, gc.unfreeze
        gc.collect = lambda *a, **k: 0          # type: ignore[assignment]
        gc.unfreeze = lambda: None              # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        gc.collect, gc.unfreeze = self._saved


def main(ctrl_fd: int) -> int:
    ctrl = socket.socket(fileno=ctrl_fd)
    _op, engine, limits = decode(ctrl.recv(MAX_MESSAGE))
    from replayer.replay.execution.environment import quiet_vllm

    quiet_vllm(os.environ.get("PREFIX_REPLAYER_VERBOSE") == "1")
    from replayer.replay.execution.environment import vllm_cache_root

    root = vllm_cache_root(engine)      # set here too: a server started by older code
    if root is not None:                # builds this process's environment without it
        os.environ["VLLM_CACHE_ROOT"] = str(root)
    try:
        info = preload(engine)
    except BaseException as exc:  # noqa: BLE001 - said to the server, which tells the client
        ctrl.send(encode(("failed", f"{type(exc).__name__}: {exc}")))
        return 1
    ctrl.send(encode(("ready", info)))
    parent = Parent(ctrl, engine, limits, torch_threads=info.get("torch_threads"))
    if engine.worker == "model":
        # A model replay's torch already runs on every core (its intra-op
        # threads): two side by side would only take turns on them.
        parent.max_parallel = 1
    code = parent.run()
    # Its children are done and it holds nothing to save: leave without the
    # interpreter's teardown, which over vLLM's imports (torch's, jemalloc's
    # threads, thousands of modules) took seconds of every `server stop`.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
