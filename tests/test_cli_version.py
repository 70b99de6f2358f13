"""``replayer --version``: the package's version, the installed vLLM, the release ranges."""

from __future__ import annotations

import re
import tomllib

from helpers_traces import REPO, cli


def test_version_names_the_package_vllm_and_the_release_ranges():
    proc = cli("--version")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    from importlib import metadata

    assert proc.stdout.splitlines() == [
        f"replayer {version}",
        f"vLLM {metadata.version('vllm')} installed; replays vLLM releases 0.26.x-0.32.x, 0.33.x-0.34.x"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", metadata.version("vllm"))
