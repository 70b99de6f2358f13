"""The store client of each rank process at TP N: a proxy to the replay's one store.

At TP 1 the model worker's connector lives in the replay's process and its
store client is the session's backend behind a
:class:`~replayer.replay.store.recording.RecordingStore` (:mod:`.store`). At
TP N each rank's connector lives in its own process (:mod:`.rank_worker`), and
the ranks must still share one store: a lookup checks every rank's keys, a
reset empties the pool of all of them, and the recorder files every rank's
operations in one table. So the client vLLM's worker makes in a rank process
is :class:`ProxyStore`, which sends each call over a Unix socket to
:class:`StoreServer` in the replay's process, where that rank's recorder
forwards it to the backend. This is the store-client seam of the one-rank
worker, stretched over a process boundary; what it adds and could hide:

* a put's bytes are read from the rank's KV tensors (the addresses vLLM's
  worker passes) and copied to the replay's process, where the recorder
  checksums them and the backend stores them; a get's bytes come back the
  same way and are copied into the rank's tensors at the addresses vLLM's
  worker passed. The recorder compares a get's bytes with its put's as they
  arrive from the backend, before that last copy (a plain ``memmove``), not
  in the rank's tensors themselves;
* ranks run at once, so their calls reach the replay's process interleaved.
  Each rank's rows wait in that rank's list until the step has ended on every
  rank (:meth:`StoreServer.flush`), then are filed rank after rank, the order
  the null executor makes (it steps the ranks one after another). A lookup
  runs on rank 0 alone, between steps, and is filed as it returns;
* only the memory store: the real Mooncake client reads and writes the
  buffers registered in its own process, which here are the rank's (refused
  in one line by :mod:`.ranks`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import types
from multiprocessing.connection import Client, Listener
from typing import Any, Callable

from replayer.replay.store.memory import ReplicateConfig
from replayer.replay.store.recording import RecordingStore

# The rows a server thread's recorder calls make wait here (per rank) until flushed.
_SERVING = threading.local()


# -- in each rank process ------------------------------------------------------
class ProxyStore:
    """``MooncakeDistributedStore`` in a rank process: every call goes to the
    replay's process (module docstring); buffers are this process's memory."""

    def __init__(self, address: str, authkey: bytes, rank: int) -> None:
        self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        self._conn.send(("hello", rank))
        self._lock = threading.Lock()
        self._loading = threading.local()

    def loading(self, request_id: str | None) -> None:
        """Name the request whose load this thread runs (sent with its gets)."""
        self._loading.request = request_id

    def _ask(self, op: str, *args: Any) -> Any:
        with self._lock:
            self._conn.send((op, args, getattr(self._loading, "request", None)))
            ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    # Nothing to set up or register: the backend lives in the replay's process.
    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def register_buffer(self, addr: int, length: int) -> int:
        return 0

    def unregister_buffer(self, addr: int) -> int:
        return 0

    def close(self) -> int:
        with self._lock:
            self._conn.close()
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._ask("batch_is_exist", list(keys))

    def batch_put_from_multi_buffers(self, keys, addrs, sizes, *rest: Any) -> list[int]:
        values = [b"".join(ctypes.string_at(a, n) for a, n in zip(ka, ks))
                  for ka, ks in zip(addrs, sizes)]
        return self._ask("put", list(keys), values, [list(s) for s in sizes], rest)

    def batch_get_into_multi_buffers(self, keys, addrs, sizes, *rest: Any) -> list[int]:
        results, values = self._ask("get", list(keys), [list(s) for s in sizes], rest)
        for value, ka, ks in zip(values, addrs, sizes):
            if value is None:
                continue
            offset = 0
            for a, n in zip(ka, ks):
                ctypes.memmove(a, value[offset:offset + n], n)
                offset += n
        return results

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self._ask(name, *args)


def proxy_module(store: dict[str, str], rank: int, made: list[ProxyStore]
                 ) -> tuple[types.ModuleType, types.ModuleType]:
    """``mooncake`` and ``mooncake.store`` as the rank's worker imports them while
    it creates its connector: its client is a :class:`ProxyStore`."""
    pkg = types.ModuleType("mooncake")
    mod = types.ModuleType("mooncake.store")

    def client() -> ProxyStore:
        made.append(ProxyStore(store["address"], bytes.fromhex(store["authkey"]), rank))
        return made[-1]

    mod.MooncakeDistributedStore = client
    mod.ReplicateConfig = ReplicateConfig
    pkg.store = mod
    return pkg, mod


# -- in the replay's process ---------------------------------------------------
class RankRecorder(RecordingStore):
    """A rank's recorder whose rows, made on a server thread, wait to be flushed."""

    def _row(self, op: str, key: str | None, nbytes: int | None, result: int | None) -> None:
        pending = getattr(_SERVING, "pending", None)
        if pending is None:
            return super()._row(op, key, nbytes, result)
        pending.append((self, (op, key, nbytes, result), getattr(self._loading, "request", None)))
        return None


def _buffers(values: list[bytes] | None, sizes: list[list[int]]) -> tuple[list, list[list[int]]]:
    """Host buffers of ``sizes`` (filled with ``values``), and each chunk's address."""
    keep, addrs = [], []
    for i, ks in enumerate(sizes):
        total = sum(ks)
        buf = (ctypes.c_char * max(total, 1))()
        if values is not None:
            ctypes.memmove(buf, values[i], total)
        base = ctypes.addressof(buf)
        offsets = [0]
        for n in ks[:-1]:
            offsets.append(offsets[-1] + n)
        keep.append(buf)
        addrs.append([base + o for o in offsets])
    return keep, addrs


class StoreServer:
    """The one store every rank process's :class:`ProxyStore` talks to: each
    rank's :class:`RankRecorder` over the session's backend."""

    def __init__(self, backend: Any, label: str, ranks: int, boundary_of: Callable,
                 ops: Any, where: str) -> None:
        self.authkey = os.urandom(16)
        self.address = os.path.join(where, "ranks.sock")
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self.recorders = [RankRecorder(backend, label, rank=r, boundary_of=boundary_of, ops=ops)
                          for r in range(ranks)]
        self.pending: list[list] = [[] for _ in range(ranks)]
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_all, args=(ranks,), daemon=True,
                                        name="replayer-store-accept")
        self._accept.start()

    def client_info(self) -> dict[str, str]:
        """What a rank process needs to reach this server."""
        return {"address": self.address, "authkey": self.authkey.hex()}

    def _accept_all(self, ranks: int) -> None:
        for _ in range(ranks):
            try:
                conn = self.listener.accept()
            except OSError:
                return                             # closed
            _, rank = conn.recv()
            t = threading.Thread(target=self._serve, args=(conn, int(rank)), daemon=True,
                                 name=f"replayer-store-rank{rank}")
            t.start()
            self._threads.append(t)

    def _serve(self, conn: Any, rank: int) -> None:
        _SERVING.pending = self.pending[rank]
        rec = self.recorders[rank]
        while True:
            try:
                op, args, loader = conn.recv()
            except (EOFError, OSError):
                return
            rec.loading(loader)
            try:
                reply = (True, self._call(rec, op, args))
            except Exception as exc:  # noqa: BLE001 - the rank raises it as its store's error
                reply = (False, f"{type(exc).__name__}: {exc}")
            finally:
                rec.loading(None)
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return

    @staticmethod
    def _call(rec: RankRecorder, op: str, args: tuple) -> Any:
        if op == "put":
            keys, values, sizes, rest = args
            keep, addrs = _buffers(values, sizes)
            res = rec.batch_put_from_multi_buffers(keys, addrs, sizes, *rest)
            del keep
            return [int(r) for r in res]
        if op == "get":
            keys, sizes, rest = args
            keep, addrs = _buffers(None, sizes)
            res = [int(r) for r in rec.batch_get_into_multi_buffers(keys, addrs, sizes, *rest)]
            values = [bytes(buf)[:sum(ks)] if r >= 0 else None
                      for r, buf, ks in zip(res, keep, sizes)]
            return res, values
        return getattr(rec, op)(*args)

    def flush(self) -> None:
        """File the rows every rank's calls made so far, rank after rank."""
        for rank, pending in enumerate(self.pending):
            rows, pending[:] = list(pending), []
            for rec, args, loader in rows:
                rec._loading.request = loader
                try:
                    RecordingStore._row(rec, *args)
                finally:
                    rec._loading.request = None

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass
