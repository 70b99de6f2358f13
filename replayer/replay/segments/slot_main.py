"""A segment slot in an interpreter of its own (:class:`.hosts.ReleaseHost`).

Started as ``python -m replayer.replay.segments.slot_main FD VERBOSE HEAD`` with
a release's or a tree's vLLM first on ``sys.path``: answers the head's calls on
the socket ``FD`` exactly as a pool process does (:func:`.hosts.serve`), and
ends with the head (process ``HEAD``).
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from replayer.replay.segments.hosts import serve


def main(argv: list[str]) -> int:
    fd, verbose, head = int(argv[1]), argv[2] == "1", int(argv[3])
    serve(Connection(fd), verbose, head)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
