"""The recorder's start check, run by vLLM as a general plugin before the model
loads (replayer/recorder/plugin.py): a directory that is not new and empty, or
cannot be written, is refused in one line on vLLM's logger, and the process
exits 1; a directory that is fine is left as it was. (The same check inside a
real `vllm serve`: tests/test_live_server.py.)"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from replayer.recorder import plugin


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _refused(monkeypatch, out) -> str:
    """The one line said; vLLM's ``vllm`` logger does not propagate to the root
    (pytest's caplog), so the line is caught on the recorder's own logger."""
    monkeypatch.setenv(plugin.RECORD_ENV, str(out))
    plugin._vllm_logging_on()          # configuring vLLM's logging resets child loggers
    kept, logger = _Kept(), logging.getLogger("vllm.prefix_replayer")
    logger.addHandler(kept)
    try:
        with pytest.raises(SystemExit) as exc:
            plugin.check_recording_can_start()
    finally:
        logger.removeHandler(kept)
    assert exc.value.code == 1
    assert len(kept.records) == 1 and kept.records[0].levelno == logging.ERROR
    return kept.records[0].getMessage()


def test_a_directory_holding_a_recording_is_refused(monkeypatch, tmp_path):
    (tmp_path / "header.json").write_text("{}")
    assert _refused(monkeypatch, tmp_path) == (
        f"prefix-replayer recorder: {tmp_path}: is not empty (holds header.json); record each "
        "run into a new, empty directory")


def test_a_directory_that_cannot_be_written_is_refused(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    disk = tmp_path / "ro"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(disk)], check=True)
    try:
        assert _refused(monkeypatch, disk / "rec") == (
            f"prefix-replayer recorder: {disk / 'rec'}: cannot record here "
            "(Read-only file system)")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_new_directory_passes_and_is_left_empty(monkeypatch, tmp_path):
    out = tmp_path / "new"
    monkeypatch.setenv(plugin.RECORD_ENV, str(out))
    plugin.check_recording_can_start()
    assert out.is_dir() and list(out.iterdir()) == []


def test_no_recording_no_check(monkeypatch):
    monkeypatch.delenv(plugin.RECORD_ENV, raising=False)
    assert plugin.check_recording_can_start() is None
