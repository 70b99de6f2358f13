"""An in-process store with Mooncake's semantics, deterministic by construction.

It implements the part of ``mooncake.store.MooncakeDistributedStore`` that
vLLM's MooncakeStore worker calls, moving real bytes between the registered KV
buffers and its own memory. Semantics follow Mooncake: a duplicate ``put``
keeps the first value (and succeeds), ``get`` of a missing key returns
OBJECT_NOT_FOUND, ``is_exist`` answers 1/0. With a capacity, the oldest
objects are evicted first (insertion order), and each eviction is reported to
the recorder.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any, Callable

from replayer.replay.store.codes import OBJECT_NOT_FOUND


class ReplicateConfig:
    """Stand-in for mooncake.store.ReplicateConfig (fields the worker sets)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.preferred_segment = ""
        self.group_ids: list[str] = []


class MemoryStore:
    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.objects: OrderedDict[str, bytes] = OrderedDict()
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.on_evict: Callable[[str, int], None] | None = None

    # -- lifecycle (arguments are Mooncake's; nothing to connect to) ----
    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def register_buffer(self, addr: int, length: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    # -- object operations --------------------------------------------
    def is_exist(self, key: str) -> int:
        return 1 if key in self.objects else 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[list[int]],
                                     sizes: list[list[int]], config: Any = None) -> list[int]:
        out = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes):
            total = sum(key_sizes)
            if key in self.objects:          # Mooncake keeps the first value
                out.append(0)
                continue
            self._make_room(total)
            self.objects[key] = b"".join(ctypes.string_at(a, n)
                                         for a, n in zip(key_addrs, key_sizes))
            self.used_bytes += total
            out.append(0)
        return out

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: list[list[int]],
                                     sizes: list[list[int]], *args: Any) -> list[int]:
        out = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes):
            value = self.objects.get(key)
            if value is None or len(value) != sum(key_sizes):
                out.append(OBJECT_NOT_FOUND if value is None else -701)
                continue
            offset = 0
            for a, n in zip(key_addrs, key_sizes):
                ctypes.memmove(a, value[offset:offset + n], n)
                offset += n
            out.append(len(value))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        value = self.objects.pop(key, None)
        if value is None:
            return OBJECT_NOT_FOUND
        self.used_bytes -= len(value)
        return 0

    def remove_all(self, force: bool = False) -> int:
        n = len(self.objects)
        self.objects.clear()
        self.used_bytes = 0
        return n

    def _make_room(self, size: int) -> None:
        if self.capacity_bytes is None:
            return
        while self.objects and self.used_bytes + size > self.capacity_bytes:
            key, value = self.objects.popitem(last=False)
            self.used_bytes -= len(value)
            if self.on_evict is not None:
                self.on_evict(key, len(value))
