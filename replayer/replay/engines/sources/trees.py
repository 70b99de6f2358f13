"""vLLM source trees as engines: the package, its release, its git identity.

A tree is a directory holding vLLM's Python package: a checkout (``PATH/vllm``)
or the package itself (a copy of an installed ``vllm/``, ``PATH/v1/...``). Its
release decides the adapter: ``vllm/_version.py`` when the tree has one (a
built checkout, an installed copy), else the nearest ``v*`` git tag. Its git
commit and whether it was dirty name it in every output; both are None when
the tree is not inside a git checkout.

Bisecting over commits needs each commit's tree without touching the user's
checkout: :func:`export_commit` writes ``git archive`` of one commit into a
directory of its own. :func:`commit_sources` keeps that export in the cache
(``cache_dir()/commits/<full commit id>``, beside the releases) with its
package compiled to bytecode, so a commit is exported and compiled once, not
by every bisect that probes it. As for releases, an export is written under a
temporary name and renamed when complete, under a file lock per commit: the
final name never holds half an export, and a commit's content never changes.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from replayer.replay.engines.base import EngineError

MARKER = Path("v1") / "engine" / "core.py"      # present in every release the adapters serve
_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def package_dir(path: Path, spec: str) -> Path:
    """The ``vllm`` package inside ``path`` (a checkout) or ``path`` itself."""
    if (path / "vllm" / MARKER).is_file():
        return path / "vllm"
    if (path / MARKER).is_file() and (path / "__init__.py").is_file():
        return path
    raise EngineError(f"engine {spec!r}: not a vLLM source tree (no vllm/{MARKER} "
                      f"or {MARKER} under {path})")


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:       # no git on this machine: treat as not a checkout
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def tree_version(package: Path) -> str | None:
    """The release a tree is: its ``_version.py``, else its nearest ``v*`` tag."""
    vfile = package / "_version.py"
    if vfile.is_file():
        m = _VERSION.search(vfile.read_text(errors="replace"))
        if m:
            return m.group(1)
    return commit_version(package, "HEAD")


def commit_version(repo: Path, commit: str) -> str | None:
    """The release a commit is, by its nearest ``v*`` tag."""
    tag = _git(repo, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", commit)
    return tag[1:] if tag and re.fullmatch(r"v\d+\.\d+\.\d+.*", tag) else None


def git_identity(path: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout holding ``path``; (None, None) outside git.

    Dirty means a tracked file under ``path`` differs from the commit, or an
    untracked file that is not ignored sits under it.
    """
    commit = _git(path, "rev-parse", "--verify", "--quiet", "HEAD")
    if not commit:
        return None, None
    status = _git(path, "status", "--porcelain", "--", ".")
    return commit, bool(status)


def resolve_commit(repo: Path, rev: str) -> str:
    sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if not sha:
        raise EngineError(f"--tree {repo}: no commit {rev!r}")
    return sha


def commits_between(repo: Path, good: str, bad: str) -> list[str]:
    """Commits from ``good`` to ``bad`` along the first-parent line, both included."""
    if _git(repo, "merge-base", "--is-ancestor", good, bad) is None:
        raise EngineError(f"--tree {repo}: {good[:12]} is not an ancestor of {bad[:12]}")
    out = _git(repo, "rev-list", "--first-parent", "--ancestry-path", "--reverse",
               f"{good}..{bad}")
    return [good, *(out.split() if out else [])]


def _toplevel(repo: Path) -> tuple[str, Path]:
    """The checkout holding ``repo``, and where ``repo`` sits inside it."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None:
        raise EngineError(f"--tree {repo}: not inside a git checkout")
    return top, repo.resolve().relative_to(Path(top).resolve())


def commit_sources(repo: Path, commit: str) -> Path:
    """Where ``repo`` lands in the cached export of ``commit``, exported if needed."""
    from replayer.replay.engines.sources.releases import (
        CACHE_ENV,
        _locked,
        cache_dir,
        compile_once,
        compile_sources,
        is_compiled,
    )

    _, rel = _toplevel(repo)
    sha = commit if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit) else \
        resolve_commit(repo, commit)
    root = cache_dir() / "commits"
    final, lock = root / sha, root / f".{sha}.lock"
    if final.is_dir():
        if not is_compiled(final):            # exported by another Python
            compile_once(final, _package_in(final / rel), lock, f"commit {sha[:12]}")
        return final / rel
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(lock):
            if final.is_dir():                # exported while we waited
                return final / rel
            print(f"replayer: exporting commit {sha[:12]} once (git archive, bytecode; "
                  f"kept in {root})", file=sys.stderr, flush=True)
            work = Path(tempfile.mkdtemp(prefix=f".{sha}.", dir=root))
            try:
                package = _package_in(export_commit(repo, sha, work / "tree"))
                compile_sources(package, work / "tree", None if package is None else
                                final / package.relative_to(work / "tree"))
                os.replace(work / "tree", final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except OSError as exc:
        raise EngineError(f"--tree {repo}: cannot use the cache directory {root} "
                          f"({exc.strerror or exc}); set {CACHE_ENV} to a writable one") from None
    return final / rel


def _package_in(tree: Path) -> Path | None:
    """What to compile: the vLLM package, not the repository's tests and docs."""
    try:
        return package_dir(tree, str(tree))
    except EngineError:                       # not a vLLM tree: said when it is used
        return None


def export_commit(repo: Path, commit: str, dest: Path) -> Path:
    """Write the tree of ``commit`` into ``dest``; returns where ``repo`` lands in it."""
    top, rel = _toplevel(repo)
    proc = subprocess.run(["git", "archive", "--format=tar", commit], cwd=top,
                          capture_output=True)
    if proc.returncode != 0:
        raise EngineError(f"--tree {repo}: git archive {commit[:12]} failed: "
                          f"{proc.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):     # Python 3.11.4 and later
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - the archive is git's own output
            tar.extractall(dest)
    return dest / rel
