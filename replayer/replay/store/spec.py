"""Parsing ``--store``: memory, mooncake, or mooncake://HOST:PORT."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StoreSpec:
    kind: str                   # "memory" | "mooncake"
    host: str | None = None     # an already running master, else one is started
    port: int | None = None
    capacity_bytes: int | None = None   # memory store only: evict beyond this

    def label(self) -> str:
        if self.kind == "memory":
            return "memory"
        if self.host is None:
            return "mooncake (started on loopback)"
        return f"mooncake://{self.host}:{self.port}"


MAX_CAPACITY = 1 << 50
_UNITS = {"": 1, "b": 1, "kb": 1024, "mb": 1024 ** 2, "gb": 1024 ** 3}


def parse_size(text: str) -> int:
    """``64MB``, ``1.5GB``, ``4096`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("kmgb")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in _UNITS or not value > 0 or not math.isfinite(value):   # nan, inf too
        raise ValueError(f"--store-capacity {text!r}: expected a size such as 64MB or 2GB")
    size = int(value * _UNITS[unit])
    if size > MAX_CAPACITY:
        raise ValueError(f"--store-capacity {text!r}: above the limit of 1 PiB")
    return size


def parse_store_spec(text: str, capacity: str | None = None) -> StoreSpec:
    spec = _parse_store_spec(text)
    if capacity is None:
        return spec
    if spec.host is not None:
        raise ValueError("--store-capacity applies to a store the replayer starts, not to "
                         f"{spec.label()}")
    return StoreSpec(spec.kind, capacity_bytes=parse_size(capacity))


def _parse_store_spec(text: str) -> StoreSpec:
    if text == "memory":
        return StoreSpec("memory")
    if text == "mooncake":
        return StoreSpec("mooncake")
    if text.startswith("mooncake://"):
        rest = text[len("mooncake://"):].rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--store {text!r}: expected mooncake://HOST:PORT")
        return StoreSpec("mooncake", host=host, port=int(port))
    raise ValueError(f"--store {text!r}: expected memory, mooncake or mooncake://HOST:PORT")
