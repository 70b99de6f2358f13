"""Engine clients kept for many replays: one per engine spec, opened on first use.

The pytest plugin keeps one pool per pytest process (per xdist worker), and
:func:`replayer.pytest.testing.replay` one per interpreter, so vLLM's start-up (~12 s
of imports) is paid once per engine, not once per replay, and not at all
while the warm server runs. Every engine, the installed vLLM included, runs
outside this process (a child, or a fork of the warm server) under the pinned
interpreter hash seed (:mod:`.determinism`), so results match the CLI's byte
for byte.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from replayer.replay.execution.environment import engine_env_defaults


class EnginePool:
    """Engine clients by spec (text), opened on first use; ``specs`` holds the
    parsed specs known so far (the plugin's ``--replayer-engine`` list first)."""

    def __init__(self, specs: dict[str, Any], store: Any) -> None:
        self.specs = specs
        self.item_specs = list(specs)               # what each target is checked on
        self.store = store
        self._runs: dict[str, Any] = {}
        self._stack = ExitStack()
        self.started = 0                            # engine clients opened (tests read it)

    def replay(self, spec: str, trace: Any, store: Any = None, **kw: Any) -> Any:
        from replayer.replay.engines.sources.specs import parse_spec
        from replayer.replay.execution.clients import engine_runner

        store = self.store if store is None else store
        if spec not in self.specs:                  # replayer.pytest.testing may name any engine
            self.specs[spec] = parse_spec(spec)
        run = self._runs.get(spec)
        if run is None:
            run = self._runs[spec] = self._stack.enter_context(engine_runner(
                self.specs[spec], own_process=True, env_defaults=engine_env_defaults()))
            self.started += 1
        if store.host is not None and connector(trace):
            from replayer.replay.store.master import wait_reachable

            wait_reachable(store.host, store.port)
        return run(trace, store=store, **kw)         # kw: a recorder hook (check.recompute)

    def close(self) -> None:
        self._runs = {}
        self._stack.close()


def connector(trace: Any) -> Any:
    """The trace's KV connector when it runs over a store backend (``--store``:
    ``mooncake_store``), or None; ``offloading`` keeps its blocks in vLLM's own
    CPU tier, so no master is started or waited for on its behalf."""
    return trace.engine.connector if trace.engine.connector == "mooncake_store" else None
