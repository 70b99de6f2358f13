"""Where the warm server listens, and whether a client may use it.

The socket sits in a directory of the user's own, mode 0700 (the socket
itself 0600): ``$PREFIX_REPLAYER_RUNTIME_DIR``, else
``$XDG_RUNTIME_DIR/prefix-replayer``, else ``<cache>/run``; one server per
Python environment (its ``sys.prefix``), since each imports its own vLLM.
A directory another user owns, or one others can enter, is refused.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

RUNTIME_ENV = "PREFIX_REPLAYER_RUNTIME_DIR"
NO_SERVER_ENV = "PREFIX_REPLAYER_NO_SERVER"


class UnsafeRuntimeDir(Exception):
    """The runtime directory is not this user's own."""


def runtime_root() -> Path:
    env = os.environ.get(RUNTIME_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "prefix-replayer"
    from replayer.replay.engines.sources.releases import cache_dir

    return cache_dir() / "run"


def runtime_dir() -> Path:
    """This environment's directory under the root (not created)."""
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    return runtime_root() / f"env-{tag}"


def server_socket() -> Path:
    return runtime_dir() / "server.sock"


def server_log() -> Path:
    return runtime_dir() / "server.log"


def server_wanted() -> bool:
    """False when PREFIX_REPLAYER_NO_SERVER is set (``--no-server`` sets it)."""
    return os.environ.get(NO_SERVER_ENV, "") in ("", "0")


def private_dir(path: Path) -> Path:
    """``path`` and its parent created mode 0700, and refused unless they are
    this user's and closed to others."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    for d in (path.parent, path):
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise UnsafeRuntimeDir(f"{d}: not a directory of this user's own")
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)
    return path
