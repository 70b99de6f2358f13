"""What a child process and every process under it cost: wall, CPU, peak memory.

``os.wait4`` on the child alone counts only the descendants the child waited
for itself, and its ``ru_maxrss`` is one process's peak, never the sum of a
pool's workers running together. Here (Linux):

* CPU seconds are exact for the whole tree: this process makes itself the
  tree's subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so a descendant its own
  parent leaves behind (a pool's worker, a fork server) is handed to it and
  reaped here with ``wait4``; each process's user + system time is counted
  once, either in its reaper's rusage or in what is reaped here.
* The peak is sampled: every ``interval`` seconds the tree's summed PSS
  (``/proc/PID/smaps_rollup``: a page shared by several processes, as after a
  fork, split among them rather than counted in each), and never below the
  largest single process's exact peak RSS from ``wait4`` (a peak between samples).
* Wall ends when the child exits. Descendants still running ``grace`` seconds
  later are killed (their CPU still counted) and reported on stderr.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants of this process are reparented to it (and reaped here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def descendants(root: int) -> list[int]:
    """Live (non-zombie) processes under ``root``, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(b")") + 2:].split(b" ", 2)[:2]
        if state != b"Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def pss_kb(pid: int) -> int:
    """``pid``'s proportional set size in kB (its RSS where smaps_rollup is missing)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return 0                               # gone between the listing and now


def run_tree(argv: list[str], interval: float = 0.1, grace: float = 10.0,
             **popen: Any) -> tuple[int, dict[str, float]]:
    """Run ``argv`` (``popen``: Popen's keywords) and every process it starts to
    the end: its exit code and ``{"wall_s", "cpu_s", "peak_rss_mb"}`` (see the
    module's docstring for what each counts). It reaps every child of this
    process, so nothing else here may have children running meanwhile."""
    become_subreaper()
    me = os.getpid()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, **popen)
    try:
        wake = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        wake = None
    cpu, max_rss_kb, peak_kb = 0.0, 0, 0
    status: int | None = None
    wall = 0.0
    deadline = float("inf")
    killed: set[int] = set()
    while True:
        try:
            pid, st, use = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:              # none left, the child included
            break
        if pid:
            cpu += use.ru_utime + use.ru_stime
            max_rss_kb = max(max_rss_kb, use.ru_maxrss)
            if pid == proc.pid:
                status, wall = st, time.perf_counter() - t0
                deadline = time.monotonic() + grace
            continue                           # reap all that are done before sampling
        tree = descendants(me)
        peak_kb = max(peak_kb, sum(pss_kb(p) for p in tree))
        if time.monotonic() > deadline:        # and again for any forked since
            killed.update(tree)
            for p in tree:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if status is None and wake is not None:
            select.select([wake], [], [], interval)
        else:
            time.sleep(interval)
    if wake is not None:
        os.close(wake)
    proc.returncode = os.waitstatus_to_exitcode(status)     # reaped here, not by Popen
    if killed:
        print(f"{argv[0]}: {len(killed)} descendant(s) still running {grace:.0f} s after it "
              f"exited were killed (pids {' '.join(map(str, sorted(killed)))}); their CPU is counted",
              file=sys.stderr, flush=True)
    return proc.returncode, {"wall_s": wall, "cpu_s": cpu,
                             "peak_rss_mb": max(peak_kb, max_rss_kb) / 1024}
