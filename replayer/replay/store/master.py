"""Starting (and stopping) a real ``mooncake_master`` on loopback, or reaching one.

The master is the binary from ``mooncake-transfer-engine-non-cuda``. It is
ready when ``GET /health`` on its metrics port answers (~0.2 s). A master that
cannot be reached fails in seconds, not after the client's 90 s retry loop.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from replayer.replay.store.codes import StoreError

READY_TIMEOUT_S = 10.0
REACH_TIMEOUT_S = 5.0
# Mooncake evicts from a full pool once objects' leases lapse and its eviction
# thread runs: wall-clock timing, so the same replay could evict on a slow
# machine and not on a fast one. The master the replayer starts never evicts:
# a pool too small fails the replay with NO_AVAILABLE_HANDLE, the same way
# every time (--store memory --store-capacity evicts oldest-first, by step).
NO_EVICTION = ("--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0")

# The shared libraries mooncake_master takes from the system (its other ones
# ship in the wheel), and the Debian/Ubuntu package that has each. A machine
# without RDMA usually lacks the first.
SYSTEM_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
    "libcurl.so.4": "libcurl4",
}
_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: ([^:\s]+): "
                              r"cannot open shared object file")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise StoreError("mooncake_master not found: pip install "
                         "mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)")
    return found


def missing_library(log: str) -> str:
    """``: the shared library X is not installed (...)`` when the master's log shows
    the dynamic loader refusing to start it (exit 127), else ``""``."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return ""
    m = _MISSING_LIBRARY.search(text)
    if m is None:
        return ""
    lib = m.group(1)
    package = SYSTEM_LIBRARIES.get(lib)
    where = (f"Debian/Ubuntu package {package}: apt-get install {package}" if package else
             f"find the package that has it, e.g. apt-file search {lib}")
    return f": the shared library {lib} is not installed ({where})"


def wait_reachable(host: str, port: int, timeout: float = REACH_TIMEOUT_S) -> None:
    """TCP-connect to the master's RPC port, or fail within ``timeout``."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.1)
    raise StoreError(f"store mooncake://{host}:{port}: master not reachable within "
                     f"{timeout:.0f} s ({last})")


class MasterProcess:
    """A mooncake_master child on free loopback ports, stopped on close."""

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.port}",
             f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
             *NO_EVICTION],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.close(keep_log=True)               # the error names it: it must be there
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        url = f"http://{self.host}:{self.metrics_port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StoreError(f"mooncake_master exited with {self.proc.returncode} at "
                                 f"start{missing_library(self.log.name)} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise StoreError(f"mooncake_master on {self.address} not healthy within "
                         f"{READY_TIMEOUT_S:.0f} s (log: {self.log.name})")

    def all_keys(self) -> list[str]:
        url = f"http://{self.host}:{self.metrics_port}/get_all_keys"
        with urllib.request.urlopen(url, timeout=5.0) as r:
            return [k for k in r.read().decode().splitlines() if k]

    def kill(self) -> None:
        """Stop the master abruptly (for fault tests)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        if keep_log:
            return
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
