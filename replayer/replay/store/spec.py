"""Parsing ``--store``: memory, mooncake, or mooncake://HOST:PORT."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traces.model import sizes


@dataclass(frozen=True)
class StoreSpec:
    kind: str                   # "memory" | "mooncake"
    host: str | None = None     # an already running master, else one is started
    port: int | None = None
    # Each rank's segment of the pool (Mooncake's global_segment_size), from
    # --store-capacity; None: the engine block's, else Mooncake's default.
    capacity_bytes: int | None = None
    # A prefill/decode pair's decode instance: the store session of the prefill
    # instance, whose store (memory or master) and operation log it shares.
    peer: Any = field(default=None, compare=False, repr=False)

    def label(self) -> str:
        if self.kind == "memory":
            return "memory"
        if self.host is None:
            return "mooncake (started on loopback)"
        return f"mooncake://{self.host}:{self.port}"


def parse_size(text: str) -> int:
    """``64MB``, ``1.5GB``, ``4096`` -> bytes (``--store-capacity``)."""
    return sizes.parse_size(text, "--store-capacity")


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
