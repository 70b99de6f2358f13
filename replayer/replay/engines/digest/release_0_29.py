"""The state digest for vLLM 0.26-0.32 (the 0.29 adapter's range): 0.33's
(:mod:`.release_0_33`), on the structures these releases share with it.

Read from each wheel's ``vllm/v1/core`` and ``v1/engine/core.py``: the
scheduler's queues and requests, the KV-cache manager, its coordinator and
single-type managers (``new_block_ids`` included), the block pool (free queue,
prefix-cache map, ``cached_block_hashes_by_block``), ``current_step`` against
each request's ``next_decode_eligible_step``, and the engine core's
``aborts_queue`` are the same objects with the same fields, walked by the same
code; a field one of these releases has that 0.33 lacks is walked unasked
(:mod:`.walk`), so it can only make a boundary fail. What differs:

* **No local prefill interval.** ``local_prefill_interval``,
  ``num_executed_steps`` and ``last_prefill_step`` came in 0.33; here no
  decision reads a distance since the last prefill, so there is none to write.
* **0.26-0.29's block pool has no reuse watchers** (``_reuse_watchers``, the
  connector's callbacks, came in 0.30): the section writes them where they are.

A field the digest reads that a release lacks fails the boundary (said once,
never trusted), as a value it cannot encode does.

The exclusions (:data:`.release_0_33.EXCLUDED`) are the same list: a name a
release lacks excludes nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from replayer.replay.engines.digest.release_0_33 import EXCLUDED, DigestError, counters, state_sections
from replayer.replay.engines.digest.walk import sha

__all__ = ["DIGEST", "DigestError", "EXCLUDED", "counters", "state_digest"]


def _scheduler(d: Any, sched: Any) -> list[str]:
    if hasattr(sched, "local_prefill_interval"):
        raise DigestError("scheduler.local_prefill_interval: a 0.33 field on a 0.29-0.32 "
                          "engine (this digest does not compare it)")
    return [d.obj(sched, "scheduler")]


def state_digest(engine: Any, loop: dict[str, int],
                 pending: Any = None) -> dict[str, str]:
    """Each section's hash, and ``total`` over them all (as 0.33's)."""
    sections = state_sections(engine, loop, pending, scheduler=_scheduler)
    parts = {name: sha(lines) for name, lines in sections.items()}
    parts["total"] = sha([f"{k}={v}" for k, v in parts.items()])
    return parts


# What the segment runner calls (one name per digest module).
DIGEST: Callable[..., dict[str, str]] = state_digest
