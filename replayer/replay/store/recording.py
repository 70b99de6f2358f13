"""Every store operation as a row of ``store_ops``, whichever backend runs.

:class:`RecordingStore` sits between vLLM's MooncakeStore worker and the
backend (the in-memory store or the real Mooncake client), forwards each call
unchanged and records it: order, step, rank, op, key, group, token boundary,
bytes, result. It also checksums each value put and each value got back, so a
replay over the real master proves the bytes read equal the bytes written.
Failures (a negative code other than OBJECT_NOT_FOUND on a get or exists) are
kept and raised by the replay loop after the step, naming the store and step:
never a silent pass. A :class:`Fault` armed by a ``store_fault`` event answers
its matching keys with its code instead of the backend (the seam vLLM's own
store tests use: the client returns an error code); those rows are recorded
with that code and are not failures, so vLLM's own error handling decides
what follows.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from replayer.replay.schedule import KeySelector
from replayer.replay.store.codes import CORRUPT, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, code_name

_GROUP = re.compile(r"@group:(\d+)@")


def key_group(key: str) -> int | None:
    m = _GROUP.search(key)
    return int(m.group(1)) if m else None


def key_hash(key: str) -> str:
    return key.rsplit("@", 1)[-1]


def _crc(addrs: list[int], sizes: list[int]) -> int:
    crc = 0
    for a, n in zip(addrs, sizes):
        crc = zlib.crc32(ctypes.string_at(a, n), crc)
    return crc


def pressure_note(label: str, kind: str, first: tuple[int, int, str], puts: int) -> str:
    """What a replay says of the puts a full pool refused (``first``: the first's
    step, rank and key)."""
    step, rank, key = first
    return (f"store {label}: the pool was full for {puts} put(s), "
            f"the first at step {step} on rank {rank} ({key}): NO_AVAILABLE_HANDLE, "
            "which vLLM's worker takes as store pressure (it skips that request's "
            "later puts until one succeeds)" + (
                "; this master never evicts (Mooncake evicts on wall-clock leases, "
                "which a replay does not repeat)" if kind == "mooncake" else ""))


@dataclass
class Fault:
    """An armed ``store_fault``: ``op`` on keys matching a selector (first
    request, group, boundary, rank; None matches any) returns ``code``, for the
    next ``times`` matching keys."""

    op: str
    selectors: tuple[KeySelector, ...]
    code: int
    times: int
    step: int                       # armed before this step
    fired: int = 0

    def takes(self, op: str, request: str | None, group: int | None,
              boundary: int | None, rank: int) -> bool:
        if self.fired >= self.times or op != self.op:
            return False
        for req, g, b, r in self.selectors:
            if req == request and g in (None, group) and b in (None, boundary) \
                    and r in (None, rank):
                self.fired += 1
                return True
        return False


@dataclass
class StoreOps:
    """The recorded operations, in the order the store saw them."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # request id -> lookup results, in order
    lookups: list[dict[str, Any]] = field(default_factory=list)
    # key -> CRC of the value first put (any rank): what a get must read back
    put_crc: dict[str, int] = field(default_factory=dict)
    # Successful gets whose bytes, once in the worker's KV buffers, were compared
    # with that CRC (the witness that the comparison ran).
    gets_checked: int = 0
    # Successful gets a CORRUPT fault served from another key (never checked).
    gets_corrupted: int = 0
    # key -> its buffers' sizes, in put order (where CORRUPT takes another key from)
    put_sizes: dict[str, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    faults: list[Fault] = field(default_factory=list)
    # The first put a full pool refused (step, rank, key), and how many it refused.
    pressure: tuple[int, int, str] | None = None
    pressure_puts: int = 0
    # A time segment's: how many key names were filed before each row (written
    # as its "names"; the head names the row's key from the exact path's).
    mark: Callable[[], int] | None = None


class RecordingStore:
    """A pass-through wrapper around a Mooncake-like store object.

    One per worker rank; ``ops`` shared by the ranks of one replay makes one
    ordered table of every rank's operations (the ranks step one after another).
    """

    def __init__(self, inner: Any, label: str, rank: int = 0,
                 boundary_of: Callable[[str], tuple[int, str] | None] | None = None,
                 ops: StoreOps | None = None) -> None:
        self._inner = inner
        self.label = label
        self.rank = rank
        # A prefill/decode pair's: the instance whose client this is (prefill or
        # decode, named by connector/pd_pair.py), written in each row but an evict.
        self.instance: str | None = None
        self.step = 0
        self.phase = "exists"          # "lookup" while the scheduler's lookup runs
        self.ops = StoreOps() if ops is None else ops
        self.boundary_of = boundary_of or (lambda h: None)
        self._lock = self.ops.lock
        # The request whose load is running on this thread (set around each load).
        self._loading = threading.local()
        self._put_crc = self.ops.put_crc
        self._put_sizes = self.ops.put_sizes
        self.seconds = 0.0            # inside the backend's calls (timings, never output)
        # A time segment of a prefill/decode pair's: which instance's names this
        # recorder's rows take (written as the row's "namer"; segments/rows.py).
        self.namer: str | None = None
        if hasattr(inner, "on_evict") and rank == 0:
            # A backend shared by the ranks files its evictions once, under rank 0.
            inner.on_evict = self._evicted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- recording ----------------------------------------------------
    def _row(self, op: str, key: str | None, nbytes: int | None, result: int | None) -> None:
        site = self.boundary_of(key_hash(key)) if key else None
        boundary, request = site if site else (None, None)
        with self._lock:
            row = {
                "order": len(self.ops.rows), "step": self.step, "rank": self.rank, "op": op,
                "key": key, "group": key_group(key) if key else None,
                "boundary": boundary, "bytes": nbytes, "result": result,
                "request": request,
                "loader": getattr(self._loading, "request", None) if op == "get" else None,
                # An evict is the pool's own, which both instances of a pair share.
                "instance": None if op == "evict" else self.instance}
            if self.ops.mark is not None:
                row["names"] = self.ops.mark()
                if self.namer is not None:
                    row["namer"] = self.namer
            self.ops.rows.append(row)

    def _fail(self, what: str) -> None:
        with self._lock:
            self.ops.failures.append(f"store {self.label}: {what} at step {self.step}")

    def _pressure(self, key: str) -> None:
        """A full pool refused a put: vLLM's worker handles that itself (it skips
        that request's later puts until one succeeds), so the replay goes on and
        the first refusal is said once, as a note."""
        with self._lock:
            if self.ops.pressure is None:
                self.ops.pressure = (self.step, self.rank, key)
            self.ops.pressure_puts += 1

    def _evicted(self, key: str, nbytes: int) -> None:
        self._row("evict", key, nbytes, 0)
        # The value is gone: a later put of the key (from another block, whose
        # bytes may differ) is what a get must read back.
        self._put_crc.pop(key, None)
        self._put_sizes.pop(key, None)

    # -- the calls vLLM's worker makes -----------------------------------
    def _call(self, fn, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(f"{getattr(fn, '__name__', 'call')} raised {exc!r}")
            raise
        finally:
            self.seconds += time.perf_counter() - t

    def _injected(self, op: str, keys: list[str]) -> dict[int, int]:
        """Index -> code of the keys an armed fault answers instead of the store."""
        if not self.ops.faults:
            return {}
        out: dict[int, int] = {}
        with self._lock:
            for i, k in enumerate(keys):
                site = self.boundary_of(key_hash(k))
                boundary, request = site if site else (None, None)
                for fault in self.ops.faults:
                    if fault.takes(op, request, key_group(k), boundary, self.rank):
                        out[i] = fault.code
                        break
        return out

    def _forward(self, fn, op: str, keys: list[str], *lists: list, rest: tuple = (),
                 injected: dict[int, int] | None = None) -> tuple:
        """The backend's results for the keys no fault answers, merged in key
        order with the injected codes; and the injected indices."""
        injected = self._injected(op, keys) if injected is None else injected
        if not injected:
            return list(self._call(fn, keys, *lists, *rest)), injected
        keep = [i for i in range(len(keys)) if i not in injected]
        res: list[int] = [injected.get(i, 0) for i in range(len(keys))]
        if keep:
            got = self._call(fn, [keys[i] for i in keep], *([xs[i] for i in keep] for xs in lists),
                             *rest)
            for i, r in zip(keep, got):
                res[i] = r
        return res, injected

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        op = self.phase
        res, injected = self._forward(self._inner.batch_is_exist, op, keys)
        for i, (k, r) in enumerate(zip(keys, res)):
            self._row(op, k, None, int(r))
            if r < 0 and i not in injected:
                self._fail(f"{op} of {k} returned {code_name(int(r))}")
        return res

    def batch_put_from_multi_buffers(self, keys, addrs, sizes, *args: Any) -> list[int]:
        crcs = [_crc(a, s) for a, s in zip(addrs, sizes)]
        res, injected = self._forward(self._inner.batch_put_from_multi_buffers, "put", keys,
                                      addrs, sizes, rest=args)
        for i, (k, s, c, r) in enumerate(zip(keys, sizes, crcs, res)):
            self._row("put", k, sum(s), int(r))
            if r < 0:
                if r == NO_AVAILABLE_HANDLE and i not in injected:
                    self._pressure(k)
                elif i not in injected:
                    self._fail(f"put of {k} returned {code_name(int(r))}")
            else:
                self._put_crc.setdefault(k, c)
                self._put_sizes[k] = list(s)
        return res

    def batch_get_into_multi_buffers(self, keys, addrs, sizes, *args: Any) -> list[int]:
        injected = self._injected("get", keys)
        # A CORRUPT fault is served, from another key: the bytes land, the get succeeds.
        corrupt = {i for i, c in injected.items() if c == CORRUPT}
        served = list(keys)
        for i in corrupt:
            del injected[i]
            other = self._other_key(keys[i], list(sizes[i]))
            if other is None:
                self._fail(f"store_fault CORRUPT on the get of {keys[i]}: no other key of "
                           "its size was put before it")
            else:
                served[i] = other
        res, injected = self._forward(self._inner.batch_get_into_multi_buffers, "get", served,
                                      addrs, sizes, rest=args, injected=injected)
        for i, (k, a, s, r) in enumerate(zip(keys, addrs, sizes, res)):
            self._row("get", k, sum(s), int(r))
            if r < 0 and r != OBJECT_NOT_FOUND:
                if i not in injected:
                    self._fail(f"get of {k} returned {code_name(int(r))}")
            elif r >= 0 and i in corrupt:
                with self._lock:
                    self.ops.gets_corrupted += 1
            elif r >= 0 and k in self._put_crc:
                if _crc(a, s) != self._put_crc[k]:
                    self._fail(f"get of {k} read back bytes that differ from the put")
                else:
                    with self._lock:
                        self.ops.gets_checked += 1
        return res

    def _other_key(self, key: str, sizes: list[int]) -> str | None:
        """The last key put before ``key`` with the same buffer sizes (CORRUPT's source)."""
        with self._lock:
            for k in reversed(list(self._put_sizes)):
                if k != key and self._put_sizes[k] == sizes:
                    return k
        return None

    def remove(self, key: str, force: bool = False) -> int:
        """Mooncake's ``remove`` (a ``store_remove`` event): recorded as op ``remove``."""
        res = int(self._call(self._inner.remove, key, force))
        self._row("remove", key, None, res)
        if res < 0:
            self._fail(f"remove of {key} returned {code_name(res)}")
        self._put_crc.pop(key, None)
        self._put_sizes.pop(key, None)
        return res

    def remove_all(self, *args: Any, **kwargs: Any) -> int:
        res = self._inner.remove_all(*args, **kwargs)
        self._row("remove_all", None, None, int(res))
        self._put_crc.clear()
        self._put_sizes.clear()
        return res

    def loading(self, request_id: str | None) -> None:
        """Name the request whose load this thread runs now (None: done)."""
        self._loading.request = request_id

    def take_failures(self) -> list[str]:
        with self._lock:
            out, self.ops.failures = self.ops.failures, []
        return out
