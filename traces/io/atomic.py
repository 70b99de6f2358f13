"""The one way files are replaced: whole or not at all, their mode and links kept.

Everything the tools write beside a user's files (``--json`` output, golden
tables, a scenario's rewritten goldens, ``--store-ops``, a recording's header)
goes through :func:`write_atomic`: the new content is written under a
temporary name in the target's own folder, flushed to disk, optionally
checked, and renamed over the target. A symlink is followed (its target is
rewritten, the link stays a link); an existing file keeps its permission
bits, a new one gets the user's umask, never ``mkstemp``'s 0600. Several
files (a trace's request and store goldens) are all written and checked
before the first is renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

Content = str | bytes | Callable[[Path], None]
Check = Callable[[Path], None]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _prepare(path: str | os.PathLike, content: Content, check: Check | None) -> tuple[Path, Path]:
    """(the temporary file, written, synced and checked; the real target)."""
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(name)
    try:
        if callable(content):
            os.close(fd)
            content(tmp)
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(content.encode() if isinstance(content, str) else content)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        if check is not None:
            check(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, target


def write_atomic_many(files: dict[Path, Content], check: Check | None = None) -> list[Path]:
    """Replace each path with its content (text, bytes, or a function writing the
    temporary path it is given). ``check(tmp)`` may raise to abandon the write:
    nothing is renamed unless every file was written and checked. Returns the
    files written (links' targets)."""
    ready: list[tuple[Path, Path]] = []
    try:
        for path, content in files.items():
            ready.append(_prepare(path, content, check))
    except BaseException:
        for tmp, _ in ready:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, target in ready:
        os.replace(tmp, target)
    return [target for _, target in ready]


def write_atomic(path: str | os.PathLike, content: Content, check: Check | None = None) -> Path:
    """Replace one file (see :func:`write_atomic_many`)."""
    return write_atomic_many({Path(path): content}, check)[0]
