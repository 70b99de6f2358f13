"""Engine processes kept for many replays: one per engine spec, started on first use.

The pytest plugin keeps one pool per pytest process (per xdist worker), and
:func:`replayer.testing.replay` one per interpreter, so vLLM's start-up (~12 s
of imports) is paid once per engine, not once per replay. Every engine, the
installed vLLM included, runs in a child whose interpreter hash seed is pinned
(:mod:`replayer.determinism`), so results match the CLI's byte for byte.
"""

from __future__ import annotations

from typing import Any


class EnginePool:
    """Engine processes by spec (text), started on first use; ``specs`` holds the
    parsed specs known so far (the plugin's ``--replayer-engine`` list first)."""

    def __init__(self, specs: dict[str, Any], store: Any) -> None:
        self.specs = specs
        self.item_specs = list(specs)               # what each target is checked on
        self.store = store
        self._procs: dict[str, Any] = {}
        self.started = 0                            # engine processes started (tests read it)

    def replay(self, spec: str, trace: Any, store: Any = None) -> Any:
        from .engine_process import EngineProcess
        from .engines.specs import parse_spec

        store = self.store if store is None else store
        if spec not in self.specs:                  # replayer.testing may name any engine
            self.specs[spec] = parse_spec(spec)
        proc = self._procs.get(spec)
        if proc is None:
            from .cli import OFFLINE_ENV, QUIET_ENV

            proc = self._procs[spec] = EngineProcess(self.specs[spec], installed_too=True,
                                                     env_defaults={**OFFLINE_ENV, **QUIET_ENV})
            self.started += 1
        if store.host is not None and connector(trace):
            from .store.master import wait_reachable

            wait_reachable(store.host, store.port)
        return proc.replay(trace, store=store)

    def close(self) -> None:
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            proc.close()


def connector(trace: Any) -> Any:
    """The trace's KV connector (``mooncake_store``), or None."""
    return trace.engine.get("connector")
