"""Where an engine runs: this process, a child process, or the warm server.

Owns everything between "replay this trace on that engine" and vLLM's own
classes: the client interface and its implementations (:mod:`.clients`,
``make_client``), the one place an engine is built (:mod:`.in_process`),
child processes for releases and trees (:mod:`.child_process`,
:mod:`.child_main`), the warm server that imports vLLM once and forks a
fresh engine per replay (:mod:`.warm`), the frames between them
(:mod:`.wire`), and what keeps every run identical (:mod:`.determinism`,
:mod:`.environment`; the GC thresholds live beside the loop they tune,
:mod:`replayer.replay.gc_tuning`). It may import ``traces``,
``replayer.replay.engines`` and ``replayer.replay.loop``; nothing here imports the CLI.

Names are imported lazily, so importing one client does not import them all.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "EngineClient": ".clients", "make_client": ".clients", "engine_runner": ".clients",
    "replay_on": ".clients", "engine_here": ".in_process", "replay_here": ".in_process",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_EXPORTS[name], __name__), name)
