"""Writing a directory (a trace) so that nothing is lost, half-written or silently replaced.

Files go through :mod:`traces.io.atomic`; a trace directory through here:

* It is built under ``.NAME.tmp-PID-XXXX`` beside its target with the user's
  umask (not mkdtemp's 0700), every file and folder fsynced, then renamed
  into place and the parent fsynced: after a crash the target is the old
  trace or the new one, never a mix.
* Temporaries a killed run left (its PID no longer alive) are removed the next
  time the same target is written; ``check DIR`` skips dot-names anyway.
* :func:`output_dir_plan` decides whether a target may be written at all: an
  existing trace only with ``force``, a recorded one never, replaced goldens
  named in a note; never the input itself, the current directory, or a path
  under a file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterable

from traces.model.errors import TraceError

_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (best effort on file systems that refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_stale(target: Path) -> list[str]:
    """Remove temporaries of ``target`` whose writer is dead; restore an old copy a
    kill left mid-swap. Returns what it did, one line each."""
    done: list[str] = []
    parent = target.parent
    if not parent.is_dir():
        return done
    for p in sorted(parent.glob(f".{target.name}.*-*-*")):
        m = _TMP_RE.match(p.name)
        if not m or m["name"] != target.name or _pid_alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and not target.exists():
            p.rename(target)                     # killed between the two renames
            done.append(f"restored {target} from {p.name}, left by a killed run")
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p}, left by a killed run")
        else:
            p.unlink(missing_ok=True)
            done.append(f"removed {p}, left by a killed run")
    return done


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """Refuse, before any work, an output file that cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise TraceError(p, f"is a directory; {option} needs a file name")
    _check_parent(p, option)
    return p


def _check_parent(p: Path, option: str) -> None:
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise TraceError(p, f"{parent} is a file, not a directory ({option})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TraceError(p, f"cannot write in {parent} (permission denied)")


def output_dir_plan(out: str | os.PathLike, force: bool,
                    inputs: Iterable[str | os.PathLike] = ()) -> list[str]:
    """Whether a trace may be written to ``out``; raises TraceError if not.

    Returns notes to say once the new trace is written (what ``force`` replaced).
    """
    p = Path(out)
    full = p.resolve()
    for src in inputs:
        if Path(src).resolve() == full:
            raise TraceError(p, "is the input; write the output to another directory")
    cwd = Path.cwd().resolve()
    if full == cwd or full in cwd.parents:
        raise TraceError(p, "is the current directory (or holds it); name a new directory")
    if p.exists() and not p.is_dir():
        raise TraceError(p, "exists and is a file, not a trace directory")
    if not p.exists():
        _check_parent(p, "-o")
        return []
    if not any(p.iterdir()):
        return []
    header = p / "header.json"
    if not header.is_file():
        raise TraceError(p, "exists and is not a trace directory; refusing to overwrite")
    kind = _source_kind(header)
    if kind == "recorded":
        raise TraceError(p, "is a recorded trace; recorded observations are never replaced "
                            "(--force does not apply: remove it yourself if you mean it)")
    if not force:
        raise TraceError(p, "exists; pass --force to replace it")
    goldens = sorted(q.name for q in (p / "golden").glob("*.parquet")) if (
        p / "golden").is_dir() else []
    note = f"replaced the existing trace {p} (--force)"
    if goldens:
        note += f", its goldens included: {', '.join(goldens)}"
    return [note]


def _source_kind(header: Path) -> str | None:
    try:
        with header.open("rb") as fh:
            data = json.loads(fh.read(1 << 20))
        return (data.get("source") or {}).get("kind")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None


def publish_dir(out: Path, fill: Callable[[Path], None]) -> Path:
    """Build a directory with ``fill(tmp)`` and rename it onto ``out`` (replacing one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = _sibling(out, "tmp")
    tmp.mkdir()                                   # 0777 & ~umask, unlike mkdtemp's 0700
    try:
        fill(tmp)
        for f in sorted(tmp.rglob("*"), reverse=True):   # files first, then their folders
            fsync_path(f)
        fsync_path(tmp)
        if out.exists():
            old = _sibling(out, "old")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(out.parent)
    return out
