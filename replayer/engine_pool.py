"""Engine processes kept for many replays: one per engine spec, started on first use.

The pytest plugin keeps one pool per pytest process (per xdist worker), and
:func:`replayer.testing.replay` one per interpreter, so vLLM's start-up (~12 s
of imports) is paid once per engine, not once per replay. Every engine, the
installed vLLM included, runs in a child whose interpreter hash seed is pinned
(:mod:`replayer.determinism`), so results match the CLI's byte for byte.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any


class EnginePool:
    """Engine processes by spec (text), started on first use; ``specs`` holds the
    parsed specs known so far (the plugin's ``--replayer-engine`` list first)."""

    def __init__(self, specs: dict[str, Any], store: Any) -> None:
        self.specs = specs
        self.item_specs = list(specs)               # what each target is checked on
        self.store = store
        self._runs: dict[str, Any] = {}
        self._stack = ExitStack()
        self.started = 0                            # engine processes started (tests read it)

    def replay(self, spec: str, trace: Any, store: Any = None) -> Any:
        from .cli import OFFLINE_ENV, QUIET_ENV
        from .engines.specs import parse_spec
        from .runner import engine_runner

        store = self.store if store is None else store
        if spec not in self.specs:                  # replayer.testing may name any engine
            self.specs[spec] = parse_spec(spec)
        run = self._runs.get(spec)
        if run is None:
            run = self._runs[spec] = self._stack.enter_context(engine_runner(
                self.specs[spec], own_process=True, env_defaults={**OFFLINE_ENV, **QUIET_ENV}))
            self.started += 1
        if store.host is not None and connector(trace):
            from .store.master import wait_reachable

            wait_reachable(store.host, store.port)
        return run(trace, store=store)

    def close(self) -> None:
        self._runs = {}
        self._stack.close()


def connector(trace: Any) -> Any:
    """The trace's KV connector (``mooncake_store``), or None."""
    return trace.engine.connector
