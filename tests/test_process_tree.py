"""benchmarks/process_tree.py: a child's figures hold every process under it.

Run in a process of its own (it makes that process a subreaper and reaps every
child of it): a child that leaves an orphan burning CPU, and two processes
holding memory at once. No timing is asserted: the orphan burns until its own
CPU clock says 0.4 s, however loaded the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import REPO

# The child: forks a grandchild that burns 0.4 s of its own CPU and is never
# waited for (the child exits at once), and one that holds 150 MB beside the
# child's own 150 MB for a second.
CHILD = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
        t = time.process_time()
        while time.process_time() - t < 0.4:
            pass
        os._exit(0)
    if os.fork() == 0:
        held = b"x" * (150 << 20)
        time.sleep(1.5)
        os._exit(0)
    held = b"x" * (150 << 20)
    time.sleep(1.5)
""")

MEASURE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import process_tree
    code, figures = process_tree.run_tree([sys.executable, "-c", sys.argv[2]])
    print(json.dumps([code, figures]))
""")


def test_cpu_and_peak_count_every_process_under_the_child():
    done = subprocess.run([sys.executable, "-c", MEASURE, str(REPO / "benchmarks"), CHILD],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    code, figures = json.loads(done.stdout)
    assert code == 0
    # os.wait4 on the child alone saw ~0: the orphan's 0.4 s is reaped here.
    assert figures["cpu_s"] >= 0.4, figures
    # Two processes of 150 MB at once: their sum, where one's peak RSS is ~160 MB.
    assert figures["peak_rss_mb"] >= 290, figures
