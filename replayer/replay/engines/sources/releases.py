"""Released vLLM versions as engines: the wheel cache and the list of releases.

A release replays from its own Python sources placed first on ``sys.path``
over the installed vLLM (the compiled kernels are never needed: the replay
runs no model). So only the wheel's Python files are kept: ``pip download
--no-deps`` fetches the wheel once (about 330 MB), the sources (45-60 MB)
are extracted under the cache directory, and the wheel is deleted. An
extracted release is never changed again; it appears under its final name
only when complete, so an interrupted fetch leaves nothing half-written and a
second fetch of the same release waits for the first (a file lock).

Sources are compiled to bytecode once, when cached (:func:`compile_sources`),
so no engine start compiles vLLM's ~3,000 modules again (about 10 s, paid by
every process when imports cannot write ``__pycache__``). A marker named by
the interpreter's cache tag is written last: a release cached before this, or
by another Python, or a compile cut short, is compiled (again) on next use.

The cache directory is ``$PREFIX_REPLAYER_CACHE``, else
``$XDG_CACHE_HOME/prefix-replayer``, else ``~/.cache/prefix-replayer``; it is
created on demand, so a clean CI machine starts from nothing.
"""

from __future__ import annotations

import compileall
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING

from replayer.replay.engines.base import EngineError

if TYPE_CHECKING:
    from filelock import FileLock

CACHE_ENV = "PREFIX_REPLAYER_CACHE"

# The releases the adapters serve, in order, as listed by `pip index versions
# vllm` on 2026-11-29 (0.26.0-0.28.0 added 2026-12-06: of 0.27, its last patch,
# 0.27.1; 0.34.0 the same day, when it was published). Bisecting over releases
# walks this list (plus the two ends when they are not on it), so no bisect ever
# scans the registry.
KNOWN_RELEASES = ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                  "0.33.0", "0.34.0")

# What a replay imports from a wheel: Python sources and the data files they
# read at import time. Kernels (.so), C/CUDA sources and the Rust binary stay out.
SOURCE_SUFFIXES = (".py", ".pyi", ".json", ".jinja", ".typed")

_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefix-replayer"


def version_key(version: str) -> tuple[int, ...]:
    """``0.29.0`` -> (0, 29, 0), for ordering releases."""
    return tuple(int(x) for x in version.split("."))


def releases_between(good: str, bad: str) -> list[str]:
    """The releases from ``good`` to ``bad`` (both included), oldest first."""
    lo, hi = sorted((good, bad), key=version_key)
    found = {v for v in KNOWN_RELEASES if version_key(lo) <= version_key(v) <= version_key(hi)}
    return sorted(found | {good, bad}, key=version_key)


def _locked(path: Path) -> FileLock:
    """An exclusive lock on the file ``path`` (``with _locked(path):``), made if
    missing and left in place: another process or thread taking it waits until it
    is released. Imported here: most commands never fetch, and filelock costs time."""
    from filelock import FileLock

    return FileLock(path)


def _marker(top: Path) -> Path | None:
    """The file saying ``top`` holds this interpreter's bytecode (None: no bytecode)."""
    tag = sys.implementation.cache_tag
    return top / f".compiled-{tag}" if tag else None


def is_compiled(top: Path) -> bool:
    marker = _marker(top)
    return marker is None or marker.exists()


def compile_sources(package: Path | None, top: Path, final: Path | None = None) -> None:
    """Bytecode for every module under ``package``, then the marker in ``top``.

    ``final``: where ``package`` will be once renamed, so tracebacks name it and
    not the temporary folder. A file that does not compile is left to the import
    that needs it (compileall says why on stderr); the marker is written anyway,
    as it is when there is no package to compile (None).
    """
    marker = _marker(top)
    if marker is None:                      # this Python writes no bytecode at all
        return
    if package is not None:
        # Worker processes are forked: not from a process running threads (deadlocks).
        workers = 0 if threading.active_count() == 1 else 1
        with redirect_stdout(sys.stderr):   # its error lines must not mix with results
            compileall.compile_dir(str(package), quiet=1, workers=workers,
                                   ddir=None if final is None else str(final))
    marker.write_text("")


def compile_once(top: Path, package: Path | None, lock: Path, what: str) -> None:
    """Compile a cached tree that has no bytecode yet, under its lock. A cache
    that cannot be written is used as it is (each process compiles in memory)."""
    try:
        with _locked(lock):
            if is_compiled(top):            # compiled while we waited
                return
            print(f"replayer: compiling {what} sources once (bytecode)",
                  file=sys.stderr, flush=True)
            compile_sources(package, top)
    except OSError:
        pass


def release_sources(version: str) -> Path:
    """The ``vllm`` package directory of release ``version``, fetched if needed."""
    root = cache_dir() / "releases"
    final = root / f"vllm-{version}"
    if (final / "vllm" / "__init__.py").exists():
        if not is_compiled(final):          # cached before sources were compiled
            compile_once(final, final / "vllm", root / f".vllm-{version}.lock",
                         f"vllm=={version}")
        return final / "vllm"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return _fetch(version, root, final)
    except OSError as exc:
        raise EngineError(f"engine vllm=={version}: cannot use the cache directory {root} "
                          f"({exc.strerror or exc}); set {CACHE_ENV} to a writable one") from None


def _fetch(version: str, root: Path, final: Path) -> Path:
    with _locked(root / f".vllm-{version}.lock"):
        if (final / "vllm" / "__init__.py").exists():    # fetched while we waited
            return final / "vllm"
        work = Path(tempfile.mkdtemp(prefix=f".vllm-{version}.", dir=root))
        started = time.monotonic()
        say = _FetchProgress(version)
        try:
            say(f"downloading the wheel once with pip (about 330 MB; sources kept in {root})")
            wheel = _download(version, work / "wheel", say)
            say(f"unpacking its Python sources and compiling them to bytecode "
                f"({wheel.stat().st_size / 1e6:.0f} MB wheel)")
            _extract_sources(wheel, work / "src")
            compile_sources(work / "src" / "vllm", work / "src", final / "vllm")
            os.replace(work / "src", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"done in {time.monotonic() - started:.0f} s")
    return final / "vllm"


class _FetchProgress:
    """Says on stderr what a release fetch is doing (it takes tens of seconds):
    each phase, and while pip downloads, the megabytes so far every few seconds."""

    EVERY_S = 5.0

    def __init__(self, version: str) -> None:
        self.prefix = f"replayer: fetching vllm=={version}: "
        self.last = 0.0

    def __call__(self, what: str) -> None:
        print(self.prefix + what, file=sys.stderr, flush=True)

    def bytes(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.EVERY_S and done < total:
            return
        self.last = now
        of = f" of {total / 1e6:.0f}" if total else ""
        self(f"downloaded {done / 1e6:.0f}{of} MB")


# pip prints byte counts ("Progress DONE of TOTAL") with --progress-bar raw from 24.1 on.
RAW_PROGRESS_SINCE = (24, 1)


def pip_version(python: str) -> tuple[int, ...]:
    """The version of the pip ``python -m pip`` runs (a venv made by ``python3 -m
    venv`` has the pip its Python bundles: 23.2.1 with 3.11); EngineError when
    that Python has no pip."""
    proc = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    m = re.match(r"pip (\d+)\.(\d+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        said = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise EngineError(f"{python} -m pip does not run ({said}): a release is fetched "
                          "with pip download; install pip in this environment")
    return int(m.group(1)), int(m.group(2))


def _download(version: str, dest: Path, progress: "_FetchProgress") -> Path:
    """The release's wheel, with this environment's own pip, whatever its version:
    pip >= 24.1 reports bytes (``--progress-bar raw``: "Progress DONE of TOTAL"
    lines on stdout, turned into a line every few seconds on stderr); an older
    one (no ``raw``) downloads with no bar, and the time so far is said instead."""
    python = sys.executable
    try:
        raw = pip_version(python) >= RAW_PROGRESS_SINCE
    except EngineError as exc:
        raise EngineError(f"engine vllm=={version}: cannot fetch the wheel: {exc}") from None
    cmd = [python, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "raw" if raw else "off",
           "--dest", str(dest), f"vllm=={version}"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as errors:
        if raw:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                m = _PIP_PROGRESS.match(line)
                if m:
                    progress.bytes(int(m.group(1)), int(m.group(2)))
                else:
                    out.write(line)
            code = proc.wait()
        else:
            proc = subprocess.Popen(cmd, stdout=out, stderr=errors, text=True)
            started = time.monotonic()
            while True:
                try:
                    code = proc.wait(timeout=progress.EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    progress(f"still downloading after {time.monotonic() - started:.0f} s "
                             "(this pip is older than 24.1: no byte counts)")
        out.seek(0)
        errors.seek(0)
        said = out.read() + errors.read()
    wheels = sorted(dest.glob(f"vllm-{version}-*.whl")) if dest.is_dir() else []
    if code != 0 or not wheels:
        lines = [ln.strip() for ln in said.splitlines()
                 if ln.strip() and not ln.startswith("WARNING")]
        why = lines[-1] if lines else f"pip exited with code {code}"
        raise EngineError(f"engine vllm=={version}: could not fetch the wheel with pip "
                          f"download: {why}")
    return wheels[0]


def _extract_sources(wheel: Path, dest: Path) -> None:
    """The wheel's ``vllm/`` Python sources and data files, nothing else."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist()
                     if n.startswith("vllm/") and n.endswith(SOURCE_SUFFIXES)
                     and ".." not in n.split("/")]
            if "vllm/__init__.py" not in names:
                raise EngineError(f"{wheel.name} holds no vllm/__init__.py; not a vLLM wheel")
            for name in names:
                zf.extract(name, dest)
    except zipfile.BadZipFile as exc:
        raise EngineError(f"{wheel.name}: not a readable wheel ({exc})") from None


def release_of(text: str) -> str | None:
    """``vllm==0.29.0`` -> ``0.29.0``; None for anything that is not X.Y.Z."""
    m = re.fullmatch(r"vllm==(\d+\.\d+\.\d+)", text)
    return m.group(1) if m else None
