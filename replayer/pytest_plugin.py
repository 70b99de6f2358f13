"""pytest plugin: every scenario YAML and trace directory is a test item.

Registered through the ``pytest11`` entry point ``replayer`` (pyproject.toml),
so ``pytest fixtures/`` (or any folder of a user's repository) collects

* each ``.yaml``/``.yml`` file with a top-level ``requests:`` key (a scenario;
  other YAML files are left alone), and
* each directory holding a ``header.json`` (a trace directory; pytest does not
  descend into it),

as one item per engine (``--replayer-engine SPEC``, repeatable; default
``installed``). An item replays its target and compares it with that engine's
goldens; a failure shows the report ``replayer check`` prints
(:mod:`replayer.golden_check`: first divergence, per-group why line, store key
differences). ``--update-golden`` rewrites the goldens and still fails, for
review; ``--store`` chooses the store backend of connector traces.

One engine process per engine per pytest process (per xdist worker with
``-n``), kept for the whole session, so vLLM's start-up (~12 s of imports) is
paid once, not once per fixture. The installed vLLM also runs in a child of
its own, whose interpreter hash seed is pinned as the CLI pins its own
(:mod:`replayer.execution.determinism`): pytest's seed is random, and vLLM frees blocks
from sets whose order depends on it.

Markers an item gets from its target: ``real_master`` when it replays a
connector trace on a real Mooncake master (``--store mooncake`` or
``mooncake://...``), ``slow`` when the trace holds at least
:data:`SLOW_REQUESTS` requests. Disable the plugin with ``-p no:replayer``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

SLOW_REQUESTS = 200
_SCENARIO = re.compile(r"^requests\s*:", re.MULTILINE)
_POOL = pytest.StashKey[Any]()             # the session's replayer.execution.pool.EnginePool


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("replayer", "prefix-replayer: scenario YAML and trace directories "
                                        "as golden tests")
    group.addoption("--replayer-engine", action="append", dest="replayer_engines",
                    metavar="SPEC", default=None,
                    help="engine to check every target on: installed (default), vllm==X.Y.Z, "
                         "or a vLLM source tree; repeat it to check each target once per engine")
    group.addoption("--update-golden", action="store_true", dest="replayer_update_golden",
                    help="rewrite the goldens from this replay; the items still fail, so the "
                         "change is reviewed before it is committed")
    group.addoption("--store", dest="replayer_store", default="memory", metavar="BACKEND",
                    help="store for traces with a connector: memory (default), mooncake "
                         "(a mooncake_master on loopback per replay) or mooncake://HOST:PORT")
    group.addoption("--store-capacity", dest="replayer_store_capacity", metavar="SIZE",
                    help="store pool size, e.g. 64MB")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: replays that take more than a few seconds")
    config.addinivalue_line("markers", "real_master: starts a real mooncake_master")
    from .engines import EngineError
    from .engines.specs import parse_spec

    specs = config.getoption("replayer_engines") or ["installed"]
    try:                                            # bad options: one line, before collection
        parsed = {s: parse_spec(s) for s in dict.fromkeys(specs)}
        store = _store_spec(config)
    except EngineError as exc:
        raise pytest.UsageError(f"--replayer-engine: {exc}") from None
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    from .execution.pool import EnginePool

    config.stash[_POOL] = EnginePool(parsed, store)


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None:
        pool.close()


def _store_spec(config: pytest.Config) -> Any:
    from .store import parse_store_spec

    return parse_store_spec(config.getoption("replayer_store"),
                            config.getoption("replayer_store_capacity"))


@pytest.fixture(scope="session")
def replayer(pytestconfig: pytest.Config):
    """Replay a scenario or trace in your own test; typed outcomes by request id::

        def test_turn2_hits(replayer):
            result = replayer("fixtures/scenarios/vllm51295_turn1_24577.yaml")
            assert result["turn2"].num_cached_tokens == 24448

    ``replayer(target, engine="installed", store=None)``; see :mod:`replayer.testing`.
    Shares the session's engine processes with the collected golden items."""
    from .testing import replay_with

    pool = pytestconfig.stash[_POOL]
    return lambda target, engine="installed", store=None: replay_with(
        pool.replay, target, engine, store)


# -- collection ---------------------------------------------------------------------------


def is_scenario_file(path: Path) -> bool:
    """A ``.yaml``/``.yml`` file with a top-level ``requests:`` key (not parsed: a
    broken scenario is still collected, and fails with its one-line error)."""
    if path.suffix not in (".yaml", ".yml"):
        return False
    try:
        return _SCENARIO.search(path.read_text(errors="replace")) is not None
    except OSError:
        return False


def is_trace_dir(path: Path) -> bool:
    return (path / "header.json").is_file()


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if is_trace_dir(path):
        return TraceDirectory.from_parent(parent, path=path)
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if is_scenario_file(file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class _Target:
    """A scenario or trace directory: one item per engine."""

    path: Path
    config: pytest.Config

    def _items(self) -> Iterator["GoldenItem"]:
        from traces import TraceError, load_target

        from .execution.pool import connector

        try:
            trace, error = load_target(self.path), None
        except TraceError as exc:                   # reported by each item, in one line
            trace, error = None, exc
        pool = self.config.stash[_POOL]
        for spec in pool.item_specs:
            item = GoldenItem.from_parent(self, name=spec, spec=spec, trace=trace, error=error)
            if trace is not None:
                if trace.requests.num_rows >= SLOW_REQUESTS:
                    item.add_marker("slow")
                if connector(trace) and pool.store.kind == "mooncake":
                    item.add_marker("real_master")
            yield item


class ScenarioFile(_Target, pytest.File):
    def collect(self) -> Iterator["GoldenItem"]:
        return self._items()


class TraceDirectory(_Target, pytest.Directory):
    def collect(self) -> Iterator["GoldenItem"]:
        return self._items()


# -- the item ------------------------------------------------------------------------------


class GoldenCheckFailed(Exception):
    """The check's report, shown as the failure (no traceback: the report says it all)."""


class GoldenItem(pytest.Item):
    """One target checked on one engine, as ``replayer check --engine SPEC TARGET``."""

    def __init__(self, *, spec: str, trace: Any, error: Exception | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec = spec
        self.trace = trace
        self.error = error

    def runtest(self) -> None:
        from . import golden_check
        from .golden_check import engine_key_of, has_goldens, no_goldens, said_before_replay
        from .engines import UnsupportedByEngine

        if self.error is not None:
            raise self.error
        pool = self.config.stash[_POOL]
        shown = self._shown_path()
        update = self.config.getoption("replayer_update_golden")
        spec = pool.specs[self.spec]
        key = engine_key_of(spec)
        if not update and said_before_replay(spec, self.trace) and not has_goldens(self.trace, key):
            raise GoldenCheckFailed("\n".join(no_goldens(shown, key)))
        try:
            result = pool.replay(self.spec, self.trace)
        except UnsupportedByEngine as exc:
            pytest.skip(f"SKIP {shown}: {exc}")
        if update:                                  # rewritten: still a failure, for review
            lines, ok = golden_check.update(self.path, self.trace, result), False
        else:
            lines, ok = golden_check.check(shown, self.trace, result)
        notes = [f"replayer: note: {n}" for n in result.notes]
        if notes:
            self.add_report_section("call", "replayer notes", "\n".join(notes))
        if not ok:
            raise GoldenCheckFailed("\n".join([*lines, *notes]))

    def _shown_path(self) -> Path:
        """The target as the CLI would name it when run from pytest's directory."""
        try:
            return self.path.relative_to(self.config.invocation_params.dir)
        except ValueError:
            return self.path

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from traces import TraceError

        from .engines import EngineError
        from .replay import ReplayError
        from .store import StoreError

        if isinstance(excinfo.value, GoldenCheckFailed):
            return str(excinfo.value)
        if isinstance(excinfo.value, (TraceError, EngineError, ReplayError, StoreError)):
            msg = " ".join(p.strip() for p in str(excinfo.value).splitlines() if p.strip())
            return f"replayer: error: {msg}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.path.name} on {self.spec}"
