"""client.parquet (tools/record_live.py's client side) is written like every other
file the tools write: through traces.io.atomic, so it gets the umask's mode, not
mkstemp's 0600. No server: write_client is called with rows directly."""

from __future__ import annotations

import os
import stat

import pytest

from replayer.recorder.live.client import CLIENT_FILE, read_client, write_client

ROWS = [
    {"id": "a", "response_id": "cmpl-a-0-x", "num_prompt_tokens": 40, "cached_tokens": 0,
     "completion_tokens": 4, "sent_s": 0.0, "latency_s": 0.0123},
    {"id": "b", "response_id": None, "num_prompt_tokens": 40, "cached_tokens": 32,
     "completion_tokens": 4, "sent_s": 0.25, "latency_s": 0.01},
]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_client_file_mode_follows_the_umask_and_reads_back(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = write_client(tmp_path, ROWS)
    finally:
        os.umask(old)
    assert path == tmp_path / CLIENT_FILE
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert read_client(tmp_path) == {r["id"]: r for r in ROWS}
    assert [p.name for p in tmp_path.iterdir()] == [CLIENT_FILE]     # no temporary left


def test_rewriting_keeps_the_existing_mode(tmp_path):
    path = write_client(tmp_path, ROWS[:1])
    path.chmod(0o640)
    write_client(tmp_path, ROWS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert set(read_client(tmp_path)) == {"a", "b"}
