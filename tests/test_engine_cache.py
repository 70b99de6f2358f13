"""Engine start-up paid once: cached releases and commits hold their bytecode.

A release cached before sources were compiled is compiled on its next use,
once; a release is fetched with whatever pip the environment has; a bisect's
commit is exported into the cache once, compiled, and reused by every later
bisect. No vLLM is imported: the trees and wheels are tiny fakes.
"""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_engines import git, init_repo
from replayer.compare.bisection import CommitLine
from replayer.replay.engines import EngineError
from replayer.replay.engines.sources.releases import release_sources

MARKER = f".compiled-{sys.implementation.cache_tag}"


def fake_package(pkg: Path, version: str = "0.33.0") -> Path:
    """A few modules laid out like vLLM's package (what ``package_dir`` looks for)."""
    (pkg / "v1" / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "v1" / "__init__.py").write_text("")
    (pkg / "v1" / "engine" / "__init__.py").write_text("")
    (pkg / "v1" / "engine" / "core.py").write_text("class EngineCore:\n    pass\n")
    return pkg


def pyc_mtimes(pkg: Path) -> dict[str, int]:
    return {str(p.relative_to(pkg)): p.stat().st_mtime_ns for p in pkg.rglob("*.pyc")}


def test_release_cached_without_bytecode_is_compiled_once(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(cache))
    top = cache / "releases" / "vllm-0.33.0"
    pkg = fake_package(top / "vllm")                 # as fetched before: no bytecode

    assert release_sources("0.33.0") == pkg
    assert capsys.readouterr().err == (
        "replayer: compiling vllm==0.33.0 sources once (bytecode)\n")
    compiled = pyc_mtimes(pkg)
    assert {Path(p).parent.name for p in compiled} == {"__pycache__"}
    assert len(compiled) == 5, compiled              # every module
    assert (top / MARKER).is_file()

    assert release_sources("0.33.0") == pkg          # compiled once: nothing said or redone
    assert capsys.readouterr().err == ""
    assert pyc_mtimes(pkg) == compiled


def test_release_compile_cut_short_is_redone_and_a_bad_module_is_not_fatal(
        tmp_path, monkeypatch, capsys):
    """Bytecode without the marker (written last) is a compile cut short: redone."""
    import py_compile

    cache = tmp_path / "cache"
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(cache))
    pkg = fake_package(cache / "releases" / "vllm-0.32.0" / "vllm", "0.32.0")
    py_compile.compile(str(pkg / "__init__.py"))     # where the cut-short compile stopped
    (pkg / "broken.py").write_text("def (:\n")      # a module that does not compile
    assert release_sources("0.32.0") == pkg
    assert capsys.readouterr().err.startswith(
        "replayer: compiling vllm==0.32.0 sources once (bytecode)\n")
    assert len(pyc_mtimes(pkg)) == 5                 # the rest compiled, broken.py skipped
    assert (pkg.parent / MARKER).is_file()           # and done: not retried on every use


def test_bisect_exports_a_commit_into_the_cache_once(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(cache))
    repo = tmp_path / "vllm-src"
    init_repo(repo)
    fake_package(repo / "vllm")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text("def test():\n    pass\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    (repo / "vllm" / "v1" / "engine" / "core.py").write_text("class EngineCore:\n    x = 2\n")
    git(repo, "commit", "-qam", "two")
    good, bad = git(repo, "rev-list", "--reverse", "HEAD").split()

    line = CommitLine(str(repo), "HEAD~1", "HEAD")
    assert line.commits == [good, bad]
    engine = line.engine(bad)
    export = cache / "commits" / bad
    assert engine.sources == str(export / "vllm")
    assert engine.info.vllm == "0.33.0" and engine.info.commit == bad
    assert (export / "vllm" / "v1" / "engine" / "core.py").read_text().endswith("x = 2\n")
    assert capsys.readouterr().err == (f"replayer: exporting commit {bad[:12]} once "
                                       f"(git archive, bytecode; kept in {cache / 'commits'})\n")
    compiled = pyc_mtimes(export)
    assert len(compiled) == 5, compiled              # the package only, not tests/
    assert (export / MARKER).is_file()
    # Compiled before the rename, yet tracebacks name the cached file, not the temporary one.
    pyc = next((export / "vllm" / "v1" / "engine" / "__pycache__").glob("core.*.pyc"))
    with open(pyc, "rb") as fh:
        fh.read(16)                                  # the header; then the code object
        assert marshal.load(fh).co_filename == str(export / "vllm" / "v1" / "engine" / "core.py")
    before = export.stat()
    line.close()
    assert export.is_dir() and pyc_mtimes(export) == compiled     # close keeps the cache

    again = CommitLine(str(repo), good, bad)         # a later bisect: reused as it is
    assert again.engine(bad).sources == str(export / "vllm")
    assert capsys.readouterr().err == ""
    after = export.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert pyc_mtimes(export) == compiled

    again.engine(good)                               # the other commit: its own export
    assert sorted(p.name for p in (cache / "commits").iterdir()) == sorted(
        [good, bad, f".{good}.lock", f".{bad}.lock"])   # nothing half-written left over
    again.close()


def fake_wheel(where: Path, version: str) -> Path:
    """A wheel laid out like vLLM's (its package, its dist-info), a few hundred bytes."""
    import zipfile

    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"vllm-{version}-py3-none-any.whl"
    info = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/_version.py", f'__version__ = "{version}"\n')
        zf.writestr("vllm/v1/__init__.py", "")
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def bundled_pip_python(tmp_path_factory) -> str:
    """The python of a venv made as a new user makes one (``python -m venv``, pip
    not upgraded): the pip its Python bundles, 23.2.1 on Python 3.11."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                   capture_output=True)
    return str(venv / "bin" / "python")


@pytest.mark.parametrize("which", ["bundled pip", "this environment's pip"])
def test_a_release_is_fetched_with_whatever_pip_the_environment_has(
        which, bundled_pip_python, tmp_path, monkeypatch, capsys):
    """pip < 24.1 has no ``--progress-bar raw``: a venv with the pip ``python3 -m venv``
    brings failed every release fetch (issue 30). The wheel comes from a local
    folder (no index), so the test downloads nothing."""
    python = bundled_pip_python if which == "bundled pip" else sys.executable
    said = subprocess.run([python, "-m", "pip", "--version"], capture_output=True,
                          text=True, check=True).stdout
    pip = tuple(int(x) for x in said.split()[1].split(".")[:2])
    assert (pip < (24, 1)) == (which == "bundled pip"), said    # no --progress-bar raw
    cache = tmp_path / "cache"
    fake_wheel(tmp_path / "wheels", "0.33.0")
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)       # no machine-wide index or links
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setattr(sys, "executable", python)          # the pip a fetch runs

    pkg = release_sources("0.33.0")
    assert pkg == cache / "releases" / "vllm-0.33.0" / "vllm"
    assert (pkg / "_version.py").read_text() == '__version__ = "0.33.0"\n'
    assert (pkg.parent / MARKER).is_file()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("replayer: fetching vllm==0.33.0: downloading the wheel once "
                             "with pip"), err
    assert err[-1].startswith("replayer: fetching vllm==0.33.0: done in "), err
    assert not any("error" in line.lower() for line in err), err

    # A release that does not exist: pip's own reason, in one line.
    with pytest.raises(EngineError, match=r"^engine vllm==0\.32\.9: could not fetch the wheel "
                                          r"with pip download: .*vllm==0\.32\.9"):
        release_sources("0.32.9")
    assert sorted(p.name for p in (cache / "releases").iterdir() if not p.name.endswith(
        ".lock")) == ["vllm-0.33.0"]                           # nothing half-written
