"""Replays for a user's own tests: typed outcomes by request id.

In a pytest test (the plugin, :mod:`replayer.pytest.plugin`, provides the
session fixture ``replayer_replay``)::

    def test_patch_keeps_the_hit(replayer_replay):
        result = replayer_replay("tests/data/turns.yaml", engine="/src/vllm")
        assert result["turn2"].num_cached_tokens == 24448

Anywhere else, :func:`replay` does the same::

    from replayer.pytest.testing import replay
    result = replay("fixtures/scenarios/vllm51295_turn1_24577.yaml")

Every replay runs in an engine process of its own (one per engine, kept until
the pytest session or this interpreter ends), whose interpreter hash seed is
pinned as the CLI pins its own, so a test sees exactly what ``replayer run``
prints, whatever the test runner's ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

from traces.model.outcome import RequestOutcome

__all__ = ["ReplayOutcomes", "replay", "replay_with"]


class ReplayOutcomes(Mapping[str, RequestOutcome]):
    """A replay's per-request outcomes by id, in arrival order.

    ``result["turn2"]`` is that request's :class:`traces.model.outcome.RequestOutcome`
    (``num_cached_tokens``,
    ``num_local_cached_tokens``, ``num_external_cached_tokens``,
    ``num_prompt_tokens``, ``arrival_step``, ``prefill_step``, ``finish_step``,
    ``aborted``, ``group_hits``); ``.engine`` says what ran, ``.summary`` the
    totals, ``.result`` is the whole :class:`replayer.replay.loop.ReplayResult`."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self._by_id = result.by_id()

    def __getitem__(self, request_id: str) -> RequestOutcome:
        try:
            return self._by_id[request_id]
        except KeyError:
            ids = list(self._by_id)
            shown = ", ".join(ids[:10]) + (", ..." if len(ids) > 10 else "")
            raise KeyError(f"no request {request_id!r} in this replay (requests: {shown})") \
                from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def engine(self) -> Any:
        return self.result.engine

    @property
    def summary(self) -> dict[str, Any]:
        return self.result.summary()

    def __repr__(self) -> str:
        return f"<ReplayOutcomes {len(self)} requests on {self.engine.label}>"


def replay_with(run: Callable[..., Any], target: Any, engine: str = "installed",
                store: Any = None) -> ReplayOutcomes:
    """Replay ``target`` (a scenario path, trace directory or loaded Trace) with
    ``run(engine, trace, store)``; bad input raises the CLI's errors."""
    from replayer.replay.store import parse_store_spec
    from traces import load_target

    trace = load_target(target) if isinstance(target, (str, Path)) else target
    if isinstance(store, str):
        store = parse_store_spec(store)
    return ReplayOutcomes(run(engine, trace, store))


_POOL: Any = None


def replay(target: Any, engine: str = "installed", store: Any = None) -> ReplayOutcomes:
    """Replay ``target`` on ``engine`` (``installed``, ``vllm==X.Y.Z`` or a source
    tree) and return its outcomes; engine processes are kept until exit."""
    global _POOL
    if _POOL is None:
        from replayer.replay.execution.pool import EnginePool
        from replayer.replay.store import parse_store_spec

        _POOL = EnginePool({}, parse_store_spec("memory"))
        atexit.register(_POOL.close)
    return replay_with(_POOL.replay, target, engine, store)
