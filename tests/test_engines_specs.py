"""Engine specs without running vLLM: bad specs, trees, the wheel cache, the bisect search.

Every bad spec exits 2 with one line before anything is fetched or imported.
The wheel cache is exercised through the real ``pip download`` against a
local wheel (``PIP_NO_INDEX``/``PIP_FIND_LINKS``), from a cache directory that
does not exist yet.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from conftest import SCENARIOS, cli_here
from helpers_engines import git, init_repo
from helpers_traces import assert_bad_input
from replayer.replay.engines import EngineError, EngineInfo
from replayer.replay.engines.sources.releases import releases_between, release_sources
from replayer.replay.engines.sources.specs import parse_spec, resolve
from replayer.replay.engines.sources.trees import git_identity

FIXTURE = SCENARIOS / "vllm51295_turn1_24577.yaml"


def fake_tree(root: Path, version: str | None = "0.33.0") -> Path:
    """The smallest directory the spec parser takes for a vLLM checkout."""
    core = root / "vllm" / "v1" / "engine" / "core.py"
    core.parent.mkdir(parents=True)
    core.write_text("# EngineCore\n")
    (root / "vllm" / "__init__.py").write_text("")
    if version is not None:
        (root / "vllm" / "_version.py").write_text(
            f"__version__ = version = '{version}'\n")
    return root


# --- bad specs: one line, exit 2, nothing run ------------------------------------------


@pytest.mark.parametrize("command", ["run", "check", "diff"])
def test_release_without_patch_number(command):
    args = [command, FIXTURE, "--engine", "vllm==0.29"]
    if command == "diff":
        args += ["--engine", "installed"]
    assert_bad_input(cli_here(*args), "engine 'vllm==0.29'", "vllm==X.Y.Z")


def test_release_with_another_operator():
    assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm>=0.29.0"), "vllm==X.Y.Z")


def test_release_outside_every_range_names_the_ranges():
    line = assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm==0.25.1"),
                            "engine 'vllm==0.25.1'", "no adapter for vLLM 0.25.1")
    assert line.endswith("(supported release ranges: 0.26.x-0.32.x, 0.33.x-0.34.x)")


def test_unknown_word_is_neither_spec_nor_path():
    assert_bad_input(cli_here("run", FIXTURE, "--engine", "nightly"), "engine 'nightly'",
                     "not 'installed', vllm==X.Y.Z, the path of a vLLM source tree or of a Python "
                     "environment")


def test_directory_that_is_not_a_vllm_tree(tmp_path):
    (tmp_path / "vllm").mkdir()
    assert_bad_input(cli_here("run", FIXTURE, "--engine", tmp_path), "not a vLLM source tree",
                     "v1/engine/core.py")


def test_tree_whose_release_cannot_be_told(tmp_path):
    tree = fake_tree(tmp_path / "t", version=None)
    assert_bad_input(cli_here("check", FIXTURE, "--engine", tree),
                     "cannot tell which vLLM release this tree is")


def test_tree_of_an_unsupported_release(tmp_path):
    tree = fake_tree(tmp_path / "t", version="0.20.1")
    assert_bad_input(cli_here("run", FIXTURE, "--engine", tree / "vllm"),
                     "no adapter for vLLM 0.20.1", "0.26.x-0.32.x, 0.33.x-0.34.x")


# --- vllm@<commit>: a commit of the checkout PREFIX_REPLAYER_VLLM_CHECKOUT names --------


def tagged_checkout(root: Path, tag: str) -> str:
    """A fake vLLM checkout (no _version.py, as a git checkout has none) with one
    commit tagged ``tag`` and one after it, as main is between releases; the
    second commit's id."""
    fake_tree(root, version=None)
    init_repo(root)
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "release")
    git(root, "tag", tag)
    (root / "vllm" / "later.py").write_text("")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "a commit of main after it")
    return git(root, "rev-parse", "HEAD")


def test_a_commit_takes_the_adapter_of_its_nearest_release(tmp_path, monkeypatch):
    sha = tagged_checkout(tmp_path / "vllm-src", "v0.28.0")
    monkeypatch.setenv("PREFIX_REPLAYER_VLLM_CHECKOUT", str(tmp_path / "vllm-src"))
    spec = parse_spec(f"vllm@{sha[:10]}")
    assert (spec.kind, spec.version, spec.commit) == ("commit", "0.28.0", sha)
    assert spec.path == tmp_path / "vllm-src"
    # Resolved: exported once into the cache, named as a tree at that commit.
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(tmp_path / "cache"))
    engine = resolve(spec)
    assert engine.info.as_dict() == {"vllm": "0.28.0", "source": "tree",
                                     "path": str(tmp_path / "vllm-src"), "commit": sha,
                                     "dirty": False}
    assert engine.sources == str(tmp_path / "cache" / "commits" / sha / "vllm")
    assert (tmp_path / "cache" / "commits" / sha / "vllm" / "later.py").is_file()


def test_a_commit_past_every_range_is_refused_in_one_line(tmp_path):
    sha = tagged_checkout(tmp_path / "src", "v0.25.0")
    env = {"PREFIX_REPLAYER_VLLM_CHECKOUT": str(tmp_path / "src")}
    line = assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm@HEAD", env=env),
                            "engine 'vllm@HEAD'", f"commit {sha[:12]} follows tag v0.25.0",
                            "no adapter for vLLM 0.25.0")
    assert line.endswith("(supported release ranges: 0.26.x-0.32.x, 0.33.x-0.34.x)")


def test_a_commit_needs_the_checkout_and_the_commit_in_it(tmp_path):
    env = {"PREFIX_REPLAYER_VLLM_CHECKOUT": ""}
    assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm@abc123", env=env),
                     "engine 'vllm@abc123'", "set PREFIX_REPLAYER_VLLM_CHECKOUT to its path")
    tagged_checkout(tmp_path / "src", "v0.33.0")
    env = {"PREFIX_REPLAYER_VLLM_CHECKOUT": str(tmp_path / "src")}
    assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm@deadbeef", env=env),
                     "no commit 'deadbeef' in", "fetch it there first")


def test_release_with_an_unusable_cache(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_bad_input(cli_here("run", FIXTURE, "--engine", "vllm==0.29.0",
                              env={"PREFIX_REPLAYER_CACHE": str(blocker)}),
                     f"cannot use the cache directory {blocker}/releases",
                     "set PREFIX_REPLAYER_CACHE to a writable one")


def test_diff_needs_exactly_two_engines():
    assert_bad_input(cli_here("diff", FIXTURE, "--engine", "installed"),
                     "diff takes exactly two --engine options (A, then B), got 1")


def test_bisect_over_releases_needs_releases():
    assert_bad_input(cli_here("bisect", FIXTURE, "--good", "installed", "--bad", "vllm==0.29.0"),
                     "bisect over releases takes --good and --bad as vllm==X.Y.Z")


def test_bisect_unknown_commit(tmp_path):
    repo = fake_tree(tmp_path / "repo")
    init_repo(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    assert_bad_input(cli_here("bisect", FIXTURE, "--tree", repo, "--good", "nope",
                              "--bad", "HEAD"),
                     f"--tree {repo}: no commit 'nope'")


# --- trees: release and identity ---------------------------------------------------------


def test_tree_identity_in_and_out_of_git(tmp_path):
    outside = fake_tree(tmp_path / "plain")
    assert git_identity(outside) == (None, None)
    spec = resolve(str(outside / "vllm"))           # the package directory works too
    assert spec.info == EngineInfo("0.33.0", "tree", path=str(outside / "vllm"),
                                   commit=None, dirty=None)
    assert spec.sources == str(outside / "vllm")

    repo = fake_tree(tmp_path / "repo")
    init_repo(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    head = git(repo, "rev-parse", "HEAD")
    assert git_identity(repo) == (head, False)
    (repo / "vllm" / "__pycache__").mkdir()         # ignored: still clean
    (repo / "vllm" / "__pycache__" / "x.pyc").write_bytes(b"")
    assert git_identity(repo) == (head, False)
    with open(repo / "vllm" / "v1" / "engine" / "core.py", "a") as fh:
        fh.write("# patched\n")
    info = resolve(str(repo)).info
    assert (info.commit, info.dirty) == (head, True)
    assert info.as_dict() == {"vllm": "0.33.0", "source": "tree", "path": str(repo),
                              "commit": head, "dirty": True}
    assert info.label == f"vllm 0.33.0 (tree {repo} @ {head[:12]}, dirty)"
    assert info.key == "vllm==0.33.0"


def test_checkout_without_version_file_uses_its_tag(tmp_path):
    repo = fake_tree(tmp_path / "repo", version=None)
    init_repo(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    git(repo, "tag", "v0.31.0")
    assert parse_spec(str(repo)).version == "0.31.0"


def test_installed_and_release_blocks_name_no_tree():
    assert EngineInfo("0.33.0").as_dict() == {"vllm": "0.33.0", "source": "installed"}
    assert EngineInfo("0.29.0", "release").label == "vllm 0.29.0 (release)"


# --- the wheel cache, from nothing, through the real pip ---------------------------------


def fake_wheel(folder: Path, version: str) -> Path:
    """A minimal valid wheel named like vLLM's, with a kernel that must not be kept."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}-py3-none-any.whl"
    dist = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/v1/engine/core.py", "# EngineCore\n")
        zf.writestr("vllm/model_executor/configs/x.json", "{}")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF not really")
        zf.writestr("vllm/csrc/kernel.cu", "// CUDA")
        zf.writestr(f"{dist}/METADATA",
                    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        zf.writestr(f"{dist}/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


def test_release_cache_starts_from_nothing(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "not" / "yet" / "there"
    wheels = tmp_path / "index"
    fake_wheel(wheels, "0.29.0")
    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))

    spec = resolve("vllm==0.29.0")
    pkg = cache / "releases" / "vllm-0.29.0" / "vllm"
    assert spec.sources == str(pkg)
    assert spec.info == EngineInfo("0.29.0", "release")
    # A fetch says what it does on stderr, phase by phase (it takes ~50 s for real).
    said = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2].split(" ")[0] for line in said] == [
        "downloading", "unpacking", "done"], said
    assert all(line.startswith("replayer: fetching vllm==0.29.0: ") for line in said), said
    # The sources, compiled to bytecode when fetched (be18e56): no kernel, no C/CUDA source.
    kept = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)
    assert kept == ["__init__.py", "model_executor/configs/x.json", "v1/engine/core.py"]
    # Nothing but the release and its lock: no wheel, no half-extracted folder.
    assert sorted(p.name for p in (cache / "releases").iterdir()) == [
        ".vllm-0.29.0.lock", "vllm-0.29.0"]

    # Fetched once: a second resolve needs no wheel at all.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    assert release_sources("0.29.0") == pkg
    assert capsys.readouterr().err == ""            # nothing to fetch, nothing said

    # A release pip cannot find: one clear error, nothing left behind.
    with pytest.raises(EngineError, match=r"engine vllm==0.31.0: could not fetch the wheel"):
        release_sources("0.31.0")
    assert not (cache / "releases" / "vllm-0.31.0").exists()
    assert not [p for p in (cache / "releases").iterdir() if p.name.startswith(".vllm-0.31.0.")
                and not p.name.endswith(".lock")]


def test_every_release_range_has_a_store_adapter_and_others_are_refused_plainly():
    """One store adapter serves 0.29-0.34 (its seams are the same there: see
    tests/test_store_releases.py); a release no store adapter serves (0.26-0.28,
    whose lookup answers a bare count) is refused by name, before any vLLM import."""
    from replayer.replay.engines import (ADAPTERS, STORE_ADAPTERS, UnsupportedByEngine,
                                  check_connector)

    assert set(ADAPTERS) - set(STORE_ADAPTERS) == {"0.26", "0.27", "0.28"}
    with pytest.raises(UnsupportedByEngine, match=r"^vllm 0.27.1: connector replay"):
        check_connector("0.27.1", "mooncake_store", "vllm 0.27.1")
    for version in ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.33.2", "0.34.0"):
        check_connector(version, "mooncake_store", f"vllm {version}")
    check_connector("0.35.0", None, "vllm 0.35.0")           # no connector: nothing to serve
    with pytest.raises(UnsupportedByEngine, match=(
            r"^vllm 0.35.0: connector replay \(mooncake_store\) is not supported on vLLM "
            r"0.35.0 yet \(its MooncakeStore API differs; replayed on 0.29.x, ")):
        check_connector("0.35.0", "mooncake_store", "vllm 0.35.0")


def test_connector_trace_without_goldens_for_a_release_is_not_replayed(tmp_path):
    """A release the store adapter serves would replay it: "no goldens" is said first,
    and nothing is fetched."""
    scenario = tmp_path / "store.yaml"
    scenario.write_text("engine: {block_size: 16, connector: mooncake_store}\n"
                        "requests:\n  - {id: a, prompt: [{stream: s, len: 40}]}\n"
                        "expect:\n  \"vllm==0.33.0\": {a: {num_cached_tokens: 0}}\n")
    cache = tmp_path / "cache"
    proc = cli_here("check", scenario, "--engine", "vllm==0.31.0",
                    env={"PREFIX_REPLAYER_CACHE": str(cache), "PIP_NO_INDEX": "1"})
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout == (f"FAIL {scenario}: no goldens for engine vllm==0.31.0 (record them "
                           "with --update-golden); not replayed\n")
    assert not cache.exists()



def test_a_release_that_does_not_exist_is_an_error_not_missing_goldens(tmp_path):
    """``check --engine vllm==0.32.9`` said "no goldens" (exit 1); following that
    advice showed pip's error. A release not known to exist is fetched before its
    goldens are looked for. (No index: pip answers from an empty folder, at once.)"""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("requests:\n  - {id: a, prompt: [{stream: s, len: 40}]}\n"
                        "expect:\n  \"vllm==0.33.0\": {a: {num_cached_tokens: 0}}\n")
    (tmp_path / "wheels").mkdir()
    env = {"PREFIX_REPLAYER_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(tmp_path / "wheels")}
    proc = cli_here("check", scenario, "--engine", "vllm==0.32.9", env=env)
    assert (proc.returncode, proc.stdout) == (2, ""), proc
    assert proc.stderr.splitlines()[-1] == (
        "replayer: error: engine vllm==0.32.9: could not fetch the wheel with pip download: "
        "ERROR: No matching distribution found for vllm==0.32.9"), proc.stderr
    assert not list((tmp_path / "cache" / "releases").glob("vllm-*"))   # nothing half-written


# --- bisect: the line and the search ----------------------------------------------------


def test_release_line_runs_from_good_to_bad():
    from replayer.compare.bisection import release_line

    assert releases_between("0.29.0", "0.31.0") == ["0.29.0", "0.30.0", "0.31.0"]
    assert release_line("vllm==0.29.0", "vllm==0.31.0") == [
        "vllm==0.29.0", "vllm==0.30.0", "vllm==0.31.0"]
    assert release_line("vllm==0.33.0", "vllm==0.31.0") == [
        "vllm==0.33.0", "vllm==0.32.0", "vllm==0.31.0"]
    # An end that is not on the known list is still on the line.
    assert releases_between("0.32.0", "0.33.1") == ["0.32.0", "0.33.0", "0.33.1"]
    with pytest.raises(EngineError, match="both vllm==0.30.0"):
        release_line("vllm==0.30.0", "vllm==0.30.0")


def _fake_result(index: int, cached: int):
    from replayer.replay.loop import ReplayResult
    from traces.model.outcome import RequestOutcome

    req = RequestOutcome(id="r", arrival_step=0, num_prompt_tokens=100, num_cached_tokens=cached,
                         num_local_cached_tokens=cached, num_external_cached_tokens=0)
    return ReplayResult(engine=EngineInfo(f"0.{index}.0", "release"), requests=[req], steps=3)


def test_search_finds_the_first_engine_that_differs_in_few_replays():
    from replayer.compare.bisection import search

    tried: list[int] = []

    def replay_one(i: int):
        tried.append(i)
        return _fake_result(i, 64 if i < 5 else 32)

    res = search(list(range(9)), replay_one, on_probe=lambda p: tried.append(f"told {p.index}"))
    assert res.first_bad is not None and res.first_bad.index == 5
    # good, bad, then halving; each told as soon as it is replayed
    assert tried == [0, "told 0", 8, "told 8", 4, "told 4", 6, "told 6", 5, "told 5"]
    assert [(p.role, p.matched_good) for p in res.path] == [
        ("good", True), ("bad", False), ("try", True), ("try", False), ("try", False)]
    assert res.change is not None and res.change.a.vllm == "0.4.0"
    assert res.change.b.vllm == "0.5.0" and res.change.tokens_gained == -32


def test_search_when_bad_matches_good():
    from replayer.compare.bisection import search

    res = search([0, 1, 2], lambda i: _fake_result(i, 64))
    assert res.first_bad is None
    assert [p.index for p in res.path] == [0, 2]


def test_bisect_prints_its_header_before_the_first_replay(tmp_path):
    """The header comes first, even when the first replay then fails (here: no wheel)."""
    env = {"PREFIX_REPLAYER_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "empty")}
    proc = cli_here("bisect", FIXTURE, "--good", "vllm==0.29.0", "--bad", "vllm==0.30.0",
                    env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "bisect over 2 releases:\n"
    assert proc.stderr.splitlines()[-1].startswith(
        "replayer: error: engine vllm==0.29.0: could not fetch the wheel")


def test_each_release_and_tree_gets_a_vllm_cache_of_its_own(tmp_path, monkeypatch):
    """vLLM's model-info cache is keyed by model class only: releases sharing one
    rewrote each other's files (a ~5 s inspection subprocess per replay)."""
    from replayer.replay.engines.sources.specs import ResolvedEngine
    from replayer.replay.execution.environment import engine_env

    monkeypatch.setenv("PREFIX_REPLAYER_CACHE", str(tmp_path / "cache"))
    a = ResolvedEngine("vllm==0.29.0", EngineInfo("0.29.0", "release"), str(tmp_path / "a"))
    b = ResolvedEngine("vllm==0.30.0", EngineInfo("0.30.0", "release"), str(tmp_path / "b"))
    installed = ResolvedEngine("installed", EngineInfo("0.33.0"))
    roots = [engine_env(e, tmp_path / "overlay").get("VLLM_CACHE_ROOT") for e in (a, b)]
    assert roots[0] != roots[1] and all(r.startswith(str(tmp_path / "cache")) for r in roots)
    assert engine_env(a, tmp_path / "overlay")["VLLM_CACHE_ROOT"] == roots[0]   # stable
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    assert "VLLM_CACHE_ROOT" not in engine_env(installed, tmp_path / "overlay")
