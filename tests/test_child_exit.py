"""An engine process ends without the interpreter's teardown (child_main.exit_now).

vLLM's engine shutdown unfreezes the whole heap, so the teardown of a process that
imported vLLM and torch walked millions of objects for seconds after its last
answer. The process now ends at once, its exit handlers run and its standard
streams flushed first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

CHILD = textwrap.dedent("""
    import atexit, sys
    from replayer.replay.execution.child_main import exit_now

    class TornDown:
        def __del__(self):
            print("torn down", flush=True)

    kept = TornDown()
    atexit.register(lambda: print("exit handler ran", flush=True))
    sys.stdout.write("unflushed;")
    exit_now()
    print("never")
""")


def test_exit_now_runs_exit_handlers_flushes_and_skips_the_teardown():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "unflushed;exit handler ran\n", proc.stdout   # no "torn down"
