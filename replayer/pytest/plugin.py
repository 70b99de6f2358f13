"""pytest plugin: scenario YAML and trace directories as test items.

Registered through the ``pytest11`` entry point ``replayer`` (pyproject.toml),
so it loads in every pytest run of an environment where the package is
installed. It therefore claims nothing another project could also claim: its
options all start with ``--replayer-``, its ini option is ``replayer_paths``,
its fixture is ``replayer_replay``, and it collects only where it is told to.

What is collected. A *target* is

* a ``.yaml``/``.yml`` file with a top-level ``requests:`` key (a scenario;
  other YAML files are left alone), or
* a directory holding a ``header.json`` (a trace directory; pytest does not
  descend into it),

and a target is collected only when it lies

* under a path of the ini option ``replayer_paths`` (a list of paths relative
  to the configuration file's directory, the rootdir; this repository's
  pyproject.toml says ``replayer_paths = ["fixtures", "examples"]``; empty by
  default), or
* at or under a path named on pytest's command line (``pytest
  fixtures/scenarios/x.yaml``, ``pytest path/to/dir``, ``pytest .``): paths
  pytest takes from ``testpaths`` or from the current directory when no path
  is given do not count.

So plain ``pytest`` in a project that does not configure ``replayer_paths``
collects no target, whatever YAML or ``header.json`` it holds.

A target is one item per engine (``--replayer-engine SPEC``, repeatable;
default ``installed``). An item replays its target and compares it with that
engine's goldens; a failure shows the report ``replayer check`` prints
(:mod:`replayer.check.goldens`: first divergence, per-group why line, store key
differences). ``--replayer-update-golden`` rewrites the goldens and still
fails, for review; ``--replayer-store`` (and ``--replayer-store-capacity``)
chooses the store backend of connector traces, as the CLI's ``--store`` and
``--store-capacity`` do.

One engine process per engine per pytest process (per xdist worker with
``-n``), kept for the whole session, so vLLM's start-up (~12 s of imports) is
paid once, not once per fixture. The installed vLLM also runs in a child of
its own, whose interpreter hash seed is pinned as the CLI pins its own
(:mod:`replayer.replay.execution.determinism`): pytest's seed is random, and vLLM frees blocks
from sets whose order depends on it.

Markers an item gets from its target: ``real_master`` when it replays a
connector trace on a real Mooncake master (``--replayer-store mooncake`` or
``mooncake://...``), ``slow`` when the trace holds at least
:data:`SLOW_REQUESTS` requests. Disable the plugin with ``-p no:replayer``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

SLOW_REQUESTS = 200
_SCENARIO = re.compile(r"^requests\s*:", re.MULTILINE)
_POOL = pytest.StashKey[Any]()             # the session's replayer.replay.execution.pool.EnginePool
_ROOTS = pytest.StashKey[tuple[Path, ...]]()  # where targets are collected (see _collect_roots)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("replayer", "prefix-replayer: scenario YAML and trace directories "
                                        "as golden tests")
    group.addoption("--replayer-engine", action="append", dest="replayer_engines",
                    metavar="SPEC", default=None,
                    help="engine to check every target on: installed (default), vllm==X.Y.Z, "
                         "or a vLLM source tree; repeat it to check each target once per engine")
    group.addoption("--replayer-worker", dest="replayer_worker", default="null",
                    choices=("null", "model"),
                    help="null (default): the null executor; model: vLLM's own model runner "
                         "over a tiny model (an engine built for this machine, e.g. "
                         "--replayer-engine .venv-serve); the goldens are the same")
    group.addoption("--replayer-update-golden", action="store_true",
                    dest="replayer_update_golden",
                    help="rewrite the goldens from this replay; the items still fail, so the "
                         "change is reviewed before it is committed")
    group.addoption("--replayer-store", dest="replayer_store", default="memory",
                    metavar="BACKEND",
                    help="store for traces with a connector: memory (default), mooncake "
                         "(a mooncake_master on loopback per replay) or mooncake://HOST:PORT")
    group.addoption("--replayer-store-capacity", dest="replayer_store_capacity", metavar="SIZE",
                    help="each rank's store segment, e.g. 64MB (as replayer's "
                         "--store-capacity)")
    parser.addini("replayer_paths", type="paths", default=[],
                  help="prefix-replayer: collect scenario YAML and trace directories under "
                       "these paths (relative to the configuration file); elsewhere only "
                       "those at or under a path named on the command line")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: replays that take more than a few seconds")
    config.addinivalue_line("markers", "real_master: starts a real mooncake_master")
    from replayer.replay.engines import EngineError
    from replayer.replay.engines.sources.specs import parse_spec

    specs = config.getoption("replayer_engines") or ["installed"]
    try:                                            # bad options: one line, before collection
        worker = config.getoption("replayer_worker")
        parsed = {s: parse_spec(s, worker) for s in dict.fromkeys(specs)}
        store = _store_spec(config)
    except EngineError as exc:
        raise pytest.UsageError(f"--replayer-engine: {exc}") from None
    except ValueError as exc:                       # the store's words, this plugin's options
        raise pytest.UsageError(re.sub(r"(?<![\w-])--store", "--replayer-store", str(exc))) \
            from None
    from replayer.replay.execution.pool import EnginePool

    config.stash[_POOL] = EnginePool(parsed, store)


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None:
        pool.close()


def _store_spec(config: pytest.Config) -> Any:
    from replayer.replay.store import parse_store_spec

    return parse_store_spec(config.getoption("replayer_store"),
                            config.getoption("replayer_store_capacity"))


@pytest.fixture(scope="session")
def replayer_replay(pytestconfig: pytest.Config):
    """Replay a scenario or trace in your own test; typed outcomes by request id::

        def test_turn2_hits(replayer_replay):
            result = replayer_replay("fixtures/scenarios/vllm51295_turn1_24577.yaml")
            assert result["turn2"].num_cached_tokens == 24448

    ``replayer_replay(target, engine="installed", store=None)``; see
    :mod:`replayer.pytest.testing`.
    Shares the session's engine processes with the collected golden items."""
    from replayer.pytest.testing import replay_with

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


def _collect_roots(config: pytest.Config) -> tuple[Path, ...]:
    """The paths at or under which targets are collected: ``replayer_paths``, and
    the paths named on the command line (not those pytest took from ``testpaths``
    or the current directory). Absolute, not resolved (as pytest names the paths it
    walks), each also resolved where symlinks make that differ."""
    roots = config.stash.get(_ROOTS, None)
    if roots is None:
        found: list[Path] = list(config.getini("replayer_paths"))
        if config.args_source == pytest.Config.ArgsSource.ARGS:
            base = config.invocation_params.dir
            for arg in config.args:
                path = base / arg.split("::", 1)[0]
                if path.exists():                  # not a --pyargs module name
                    found.append(path)
        absolute = [Path(os.path.abspath(p)) for p in found]
        roots = tuple(dict.fromkeys([*absolute, *(p.resolve() for p in absolute)]))
        config.stash[_ROOTS] = roots
    return roots


def _collects(config: pytest.Config, path: Path) -> bool:
    for candidate in dict.fromkeys([Path(os.path.abspath(path)), path.resolve()]):
        if any(candidate == root or candidate.is_relative_to(root)
               for root in _collect_roots(config)):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if is_trace_dir(path) and _collects(parent.config, path):
        return TraceDirectory.from_parent(parent, path=path)
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if is_scenario_file(file_path) and _collects(parent.config, file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class _Target:
    """A scenario or trace directory: one item per engine."""

    path: Path
    config: pytest.Config

    def _items(self) -> Iterator["GoldenItem"]:
        from replayer.replay.execution.pool import connector
        from traces import TraceError, load_target

        try:
            trace, error = load_target(self.path), None
        except TraceError as exc:                   # reported by each item, in one line
            trace, error = None, exc
        pool = self.config.stash[_POOL]
        for spec in pool.item_specs:
            items = [GoldenItem.from_parent(self, name=spec, spec=spec, trace=trace,
                                            error=error)]
            if trace is not None and trace.expect_recompute:
                items.append(RecomputeItem.from_parent(self, name=f"{spec}:recompute", spec=spec,
                                                       trace=trace, error=error))
            for item in items:
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


def _pytest_hint(report: str) -> str:
    """The CLI's report, its hint naming this plugin's option (pytest has no
    ``--update-golden``)."""
    return report.replace("(record them with --update-golden)",
                          "(record them with --replayer-update-golden)")


class GoldenItem(pytest.Item):
    """One target checked on one engine, as ``replayer check --engine SPEC TARGET``."""

    def __init__(self, *, spec: str, trace: Any, error: Exception | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec = spec
        self.trace = trace
        self.error = error

    def runtest(self) -> None:
        from replayer.check import goldens as golden_check
        from replayer.check.goldens import (
            engine_key_of,
            has_goldens,
            no_goldens,
            said_before_replay,
        )
        from replayer.replay.engines import UnsupportedByEngine
        from replayer.replay.engines.sources.specs import resolve_unless_known

        if self.error is not None:
            raise self.error
        pool = self.config.stash[_POOL]
        shown = self._shown_path()
        update = self.config.getoption("replayer_update_golden")
        spec = pool.specs[self.spec]
        resolve_unless_known(spec)          # a release that does not exist: its error, first
        key = engine_key_of(spec)
        if not update and said_before_replay(spec, self.trace) and not has_goldens(self.trace, key):
            raise GoldenCheckFailed(_pytest_hint("\n".join(no_goldens(shown, key))))
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
            raise GoldenCheckFailed(_pytest_hint("\n".join([*lines, *notes])))

    def _shown_path(self) -> Path:
        """The target as the CLI would name it when run from pytest's directory.
        (RecomputeItem shares it.)"""
        try:
            return self.path.relative_to(self.config.invocation_params.dir)
        except ValueError:
            return self.path

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from replayer.replay.engines import EngineError
        from replayer.replay.loop import ReplayError
        from replayer.replay.store import StoreError
        from traces import TraceError

        if isinstance(excinfo.value, GoldenCheckFailed):
            return str(excinfo.value)
        if isinstance(excinfo.value, (TraceError, EngineError, ReplayError, StoreError)):
            msg = " ".join(p.strip() for p in str(excinfo.value).splitlines() if p.strip())
            return f"replayer: error: {msg}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.path.name} on {self.spec}"


class RecomputeItem(GoldenItem):
    """A scenario's ``expect_recompute: true`` on one engine: every hit gives what a
    cold recompute gives (``replayer check --worker model --recompute``). It needs
    the model worker; on the null executor it is skipped, saying why. Its verdict
    is the recompute's alone, goldens or none (where there are none for the
    engine, a report section says so; the golden item fails on its own)."""

    def runtest(self) -> None:
        from replayer.check.goldens import has_goldens
        from replayer.check.recompute import hit_replay, recompute_check, report_lines

        if self.error is not None:
            raise self.error
        pool = self.config.stash[_POOL]
        spec = pool.specs[self.spec]
        if spec.worker != "model":
            pytest.skip("expect_recompute is checked on the model worker: --replayer-worker "
                        "model, with an engine that runs a model (e.g. --replayer-engine "
                        ".venv-serve)")
        replay = lambda t, **kw: pool.replay(self.spec, t, **kw)  # noqa: E731
        result, log = hit_replay(self.trace, replay)
        report = recompute_check(self.trace, result, replay, log)
        if not has_goldens(self.trace, result.engine.key):
            self.add_report_section("call", "replayer notes", (
                f"{self._shown_path()}: no goldens for engine {result.engine.key}: the "
                "verdict is the recompute's alone"))
        if report.wrong:
            raise GoldenCheckFailed("\n".join(report_lines(self._shown_path(), report)))
