"""Parsing ``--store``: memory, mooncake, or mooncake://HOST:PORT."""

from __future__ import annotations

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


def parse_store_spec(text: str) -> StoreSpec:
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
