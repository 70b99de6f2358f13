"""Canonical text of an engine's objects, walked by structure, for a state digest.

A state digest (:mod:`.release_0_33`) proves a time segment exact by comparing
two engines' state. It must see every field, including ones added to vLLM
after the digest was written, and it must never let a value it cannot read
count as equal. So this walker writes an object as its type and *all* its
fields, recursively, except those the caller's exclusion table names (each
with its reason), and a value of a type it does not know raises
:class:`DigestError` instead of encoding as nothing: the boundary is then not
trusted and the segment before replays on into it.

What it knows: ``None``, numbers, strings, bytes, enums, classes, numpy
arrays (dtype, shape and contents), lists, tuples, deques, dicts (in order),
sets (in iteration order, which vLLM may depend on; sorted where elements hash
by identity, whose order no replay can depend on), and objects of vLLM's and
the replayer's own classes. Objects met by reference (vLLM's blocks and
requests) are written as a label by a hook the caller gives; a block is
named by where the walk first meets it, never by its physical id.
"""

from __future__ import annotations

import ctypes
import hashlib
from array import array
from collections import deque
from enum import Enum
from typing import Any, Callable, Mapping

import numpy as np

# Classes from these packages are state to walk field by field; any other
# object (a thread lock, a partial, a tensor, a queue.Queue) is an error.
WALKED_PACKAGES = ("vllm.", "replayer.")
_CTYPES = (ctypes.Structure, ctypes.Union, ctypes.Array, ctypes._SimpleCData)


class DigestError(Exception):
    """A value the digest cannot encode: the boundary it was taken at is not trusted."""


_SLOTS: dict[type, tuple[str, ...]] = {}
_MISSING = object()


def _slot_names(kind: type) -> tuple[str, ...]:
    out: list[str] = []
    for cls in kind.__mro__:
        slots = getattr(cls, "__slots__", ())
        out.extend(n for n in ((slots,) if isinstance(slots, str) else slots)
                   if not n.startswith("__"))          # __dict__, __weakref__
    return tuple(out)


def fields(x: Any) -> list[tuple[str, Any]]:
    """An object's fields: its slots through the class tree, then its ``__dict__``."""
    kind = type(x)
    names = _SLOTS.get(kind)
    if names is None:
        names = _SLOTS[kind] = _slot_names(kind)
    out = []
    for name in names:
        value = getattr(x, name, _MISSING)
        if value is not _MISSING:
            out.append((name, value))
    if hasattr(x, "__dict__"):
        out.extend(vars(x).items())
    return out


def _hashes_by_identity(v: Any) -> bool:
    return type(v).__hash__ is object.__hash__


class Canon:
    """Writes objects as canonical text.

    ``excluded`` maps a class name (any class in an object's MRO) to the
    fields left out of it and why; ``refs`` maps a type to the function that
    writes a reference to one of its instances (a label) instead of walking it.
    """

    def __init__(self, excluded: Mapping[str, Mapping[str, str]],
                 refs: Mapping[type, Callable[[Any], str]]) -> None:
        self.excluded = excluded
        self.refs = tuple(refs.items())
        self._seen: dict[int, int] = {}
        self._skipped: dict[type, frozenset[str]] = {}

    def skipped(self, x: Any) -> frozenset[str]:
        """The fields of ``x`` its class (or a base) excludes."""
        kind = type(x)
        out = self._skipped.get(kind)
        if out is None:
            out = self._skipped[kind] = frozenset(
                name for cls in kind.__mro__ for name in self.excluded.get(cls.__name__, ()))
        return out

    def enc(self, x: Any, path: str) -> str:
        if x is None or isinstance(x, (bool, int, float, str)):
            return repr(x)
        if isinstance(x, (bytes, bytearray)):
            return "h" + bytes(x).hex()
        if isinstance(x, Enum):
            return f"{type(x).__name__}.{x.name}"
        if isinstance(x, type):
            return f"class {x.__module__}.{x.__qualname__}"
        for kind, ref in self.refs:
            if isinstance(x, kind):
                return ref(x)
        if isinstance(x, array):
            # vLLM 0.34's TokenBuffer (token ids): an array of the vllm package whose
            # contents no field holds, so walked as an object it would encode as nothing.
            return (f"A{x.typecode}{len(x)}:"
                    + hashlib.blake2b(x.tobytes(), digest_size=16).hexdigest())
        if isinstance(x, np.ndarray):
            return (f"nd {x.dtype.str}{list(x.shape)}:"
                    + hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).hexdigest())
        if isinstance(x, (list, tuple, deque)):
            return self._sequence(x, path)
        if isinstance(x, dict):
            return "{" + ",".join(f"{self.enc(k, path)}:{self.enc(v, f'{path}[{k!r}]')}"
                                  for k, v in x.items()) + "}"
        if isinstance(x, (set, frozenset)):
            items = [self.enc(v, f"{path}{{}}") for v in x]
            if any(_hashes_by_identity(v) for v in x):
                items.sort()
            return "{" + ",".join(items) + "}"
        if isinstance(x, _CTYPES):
            # Its fields are descriptors on the class, in neither __slots__ nor
            # __dict__: walked as an object it would encode as nothing.
            raise DigestError(f"{path}: a ctypes {type(x).__qualname__}, whose fields the "
                              "state digest does not walk")
        module = type(x).__module__ + "."
        if module.startswith(WALKED_PACKAGES) and (hasattr(x, "__dict__")
                                                   or hasattr(type(x), "__slots__")):
            return self.obj(x, path)
        raise DigestError(f"{path}: a {type(x).__module__}.{type(x).__qualname__}, which the "
                          "state digest cannot encode")

    def _sequence(self, x: Any, path: str) -> str:
        if x and type(x[0]) is int:
            try:                               # token lists: hashed, not spelled out
                return (f"I{len(x)}:"
                        + hashlib.blake2b(array("q", x).tobytes(), digest_size=16).hexdigest())
            except (TypeError, OverflowError):
                pass
        if x and type(x[0]) is bytes and all(type(v) is bytes for v in x):
            h = hashlib.blake2b(digest_size=16)     # block hashes: the same
            for v in x:
                h.update(len(v).to_bytes(2, "little") + v)
            return f"H{len(x)}:{h.hexdigest()}"
        name = type(x).__name__ if type(x) not in (list, tuple) else ""
        return name + "[" + ",".join(self.enc(v, f"{path}[{i}]") for i, v in enumerate(x)) + "]"

    def obj(self, x: Any, path: str, also_skip: frozenset[str] = frozenset()) -> str:
        """An object as its type and every field not excluded (each object once:
        met again, it is named by the order it was first met in)."""
        key = id(x)
        if key in self._seen:
            return f"<again {type(x).__name__} {self._seen[key]}>"
        self._seen[key] = len(self._seen)
        skip = self.skipped(x) | also_skip if also_skip else self.skipped(x)
        body = ",".join(f"{k}={self.enc(v, f'{path}.{k}')}"
                        for k, v in fields(x) if k not in skip)
        return f"{type(x).__name__}({body})"


def sha(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]
