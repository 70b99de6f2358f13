"""``replayer report``: the page renders in a real headless Chromium (Debian's package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import REPO, cli
from replayer.analysis.sweep import comparable, parse_grid, run_sweep

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=10000"]

TINY = """\
engine: {block_size: 16, num_gpu_blocks: 24, max_num_seqs: 2, max_num_batched_tokens: 512}
requests:
  - {id: a, prompt: [{stream: doc, len: 300}]}
  - {id: b, after: a, prompt: [{stream: other, len: 300}]}
  - {id: c, after: b, prompt: [{stream: doc, len: 300}]}
"""


def chromium() -> str:
    # scripts/system-deps.sh installs it (make test): missing is a failure, never a skip.
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed (scripts/system-deps.sh installs it)"
    return path


def browse(page, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *extra,
                           page.as_uri()], capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path):
    target = tmp_path / "tiny.yaml"
    target.write_text(TINY)
    keys, points = parse_grid(["num_gpu_blocks=24,40"])
    rows = run_sweep(str(target), points, executor="serial")
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"grid": keys, "base": [], "rows": comparable(rows)}))
    page = tmp_path / "report.html"
    proc = cli("report", str(target), "-o", page, "--sweep", sweep, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    # Self-contained: plotly.js inline, nothing fetched from anywhere.
    assert not re.search(r"<script[^>]+src=", text)
    assert "<link" not in text
    dom = browse(page, tmp_path, "--dump-dom", "--enable-logging=stderr", "--v=0")
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    # 4 figures of the replay + hit rate against the one swept key, all drawn by plotly.
    assert 'data-figures="5"' in body, body
    assert 'data-errors="0"' in body, body
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln]
    assert not [ln for ln in console if re.search(r"error|uncaught", ln, re.I)], console
    for fig in ("hit-rate-over-time", "reachable-vs-actual", "lost-by-cause",
                "per-group-hits", "sweep-num_gpu_blocks"):
        assert f'id="fig-{fig}"' in dom.stdout, fig
    shot = tmp_path / "report.png"
    got = browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1200,3000")
    assert got.returncode == 0, got.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000   # drawn, not a blank page


def test_bad_sweep_file_is_one_line(tmp_path):
    bad = tmp_path / "sweep.json"
    bad.write_text('{"rows": []}')
    proc = cli("report", REPO / "fixtures" / "scenarios" / "reset_prefix_cache.yaml",
               "-o", tmp_path / "r.html", "--sweep", bad)
    assert proc.returncode == 2 and "not the --json of replayer sweep" in proc.stderr
    assert not (tmp_path / "r.html").exists()
