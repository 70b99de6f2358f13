"""A prefill/decode pair over one MooncakeStore: two engines in one replay.

``engine.prefill_instance`` makes the replay a disaggregated deployment: each
request goes first to a prefill instance (the engine block with that
mapping's ``connector_config``, e.g. ``kv_role: kv_producer``) with one output
token, as a disaggregated proxy sends it (vLLM's P/D proxy examples send the
prefiller ``max_tokens: 1``), then to the decode instance (the engine block as
written, e.g. ``kv_role: kv_consumer``) with its whole output. Both are the
release's own engine and MooncakeStore connector, built by the release's
adapter, over one store (the memory store, or one master) and one log of
store operations; the decode instance's outcomes are the replay's, so its
``num_external_cached_tokens`` is what the prefill instance left in the store.

The one seam this adds is the hand-off. A proxy forwards a request when the
prefill's response arrives, while the prefill instance's next step issues the
request's finish-time puts (vLLM queues a Mamba tail for "the next connector
step"); here the decode instance receives it after that step, every time, so
the store holds every put the prefill instance made for it. A decode lookup
that races those puts in production, and misses them, is not replayed.

Every ``store_ops`` row but an evict names the instance whose store client
made it (``instance``: prefill or decode); an evict is the shared pool's own.

What is the decode instance's alone: events (``reset_prefix_cache`` empties
both GPU caches; ``evict``, KV-cache events and explain's lookups are the
decode instance's), the lookups golden (the prefill instance's lookups run
and are in ``store_ops``, but are not filed for the golden), the engine info.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from replayer.replay.engines.base import EngineAdapter, EngineRequest, StepResult
from replayer.replay.schedule import KeySelector
from replayer.replay.store import StoreSpec
from traces.model.engine_spec import EngineBlock


def open_pair(open_one: Callable[..., Any], engine: EngineBlock, version: str,
              store: StoreSpec | None, kv_events: bool, **extra: Any) -> "PrefillDecodePair":
    """The prefill instance, then the decode instance sharing its store, each
    built by the release adapter's ``open_one`` (its ``open_engine``)."""
    prefill = open_one(engine.prefill_engine(), version, store=store, **extra)
    try:
        shared = replace(store or StoreSpec("memory"), peer=prefill.session)
        decode = open_one(engine, version, store=shared, kv_events=kv_events, **extra)
    except BaseException:
        prefill.close()
        raise
    return PrefillDecodePair(prefill, decode)


class PrefillDecodePair(EngineAdapter):
    """Two engines stepped as one: the prefill instance, then the decode instance."""

    supports_kv_events = True          # the decode instance's

    def __init__(self, prefill: Any, decode: Any) -> None:
        super().__init__()
        self.prefill, self.decode = prefill, decode
        self.info = decode.info
        self.dropped = decode.dropped
        self.notes = [*prefill.notes, *(n for n in decode.notes if n not in prefill.notes)]
        prefill.session.files_lookups = False
        for tag, one in (("prefill", prefill), ("decode", decode)):
            for rank in one.session.ranks:      # each store_ops row names its instance
                rank.recorder.instance = tag
        self._waiting: dict[str, EngineRequest] = {}   # at the prefill instance
        self._ready: list[EngineRequest] = []          # prefilled; decode after one more step
        self._steps = 0

    # -- the loop's interface ----------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._waiting[request.id] = request
        self.prefill.add_request(replace(request, output_len=1))

    def step(self) -> StepResult:
        """One step of the pair: the prefill instance's, then the decode
        instance's; both count the pair's steps, so ``store_ops`` rows of either
        are on one step clock."""
        ready, self._ready = self._ready, []
        executed = False
        self.prefill._step = self.decode._step = self._steps
        self._steps += 1
        if self.prefill.has_unfinished():
            done = self.prefill.step()
            executed = done.executed
            self._ready = [self._waiting.pop(rid) for rid in done.finished
                           if rid in self._waiting]
        for request in ready:          # finished before this step of the prefill instance
            self.decode.add_request(request)
        if not self.decode.has_unfinished():
            return StepResult(executed=executed)
        result = self.decode.step()
        result.executed = result.executed or executed
        return result

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self.prefill.has_unfinished() or \
            self.decode.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        return self.prefill.reset_prefix_cache() & self.decode.reset_prefix_cache()

    def abort(self, request_id: str) -> None:
        if self._waiting.pop(request_id, None) is not None:
            self.prefill.abort(request_id)
        self._ready = [r for r in self._ready if r.id != request_id]
        self.decode.abort(request_id)

    def vllm_seconds(self) -> float:
        return self.prefill.vllm_seconds() + self.decode.vllm_seconds()

    def close(self) -> None:
        try:
            self.decode.close()         # its session restores what the prefill's set
        finally:
            self.prefill.close()

    # -- a time segment's naming logs: one log, each naming tagged by instance
    def start_name_log(self) -> None:
        """Each instance names store keys by its own first requests (its own
        ``boundaries``), and its recorder names its rows from that map. So both
        file their namings into one log in order, each tagged with the instance
        (:class:`TaggedLog`), and each row notes the instance that wrote it
        (``namer``): the head keeps one map per instance (segments/rows.py)."""
        self.decode.start_name_log()
        self.prefill.start_name_log()
        if self.decode.name_log is None:
            return
        shared: list[tuple[str, int, str, str]] = []
        for tag, one in (("prefill", self.prefill), ("decode", self.decode)):
            one.name_log = TaggedLog(shared, tag)
            for rank in one.session.ranks:
                rank.recorder.namer = tag
        self.decode.session.ops.mark = shared.__len__

    def segment_marks(self) -> dict[str, int]:
        return self.decode.segment_marks()

    def segment_logs(self) -> dict[str, Any]:
        logs = self.decode.segment_logs()
        if "store_names" in logs:
            logs["store_names"] = logs["store_names"].entries
        return logs

    # -- the store: one store and one log, events through the decode instance
    def store_report(self) -> dict[str, Any] | None:
        report = self.decode.store_report()
        if report is not None:
            report["seconds"] += sum(r.recorder.seconds for r in self.prefill.session.ranks)
        return report

    def store_remove(self, keys: tuple[KeySelector, ...]) -> list[str]:
        self.prefill.session.drain_saves()
        return self.decode.store_remove(keys)

    def store_fault(self, op: str, keys: tuple[KeySelector, ...], code: int,
                    times: int) -> None:
        self.prefill.session.drain_saves()       # faults apply from this step on
        self.decode.store_fault(op, keys, code, times)

    # -- the rest is the decode instance's -----------------------------------
    @property
    def scheduler(self) -> Any:
        """The decode instance's vLLM scheduler (what a caller reads of one engine's state)."""
        return self.decode.scheduler

    @property
    def prefix_hashes(self) -> Any:
        return self.decode.prefix_hashes

    def ask_top_logprobs(self, k: int | None) -> None:
        self.decode.ask_top_logprobs(k)

    def hold_accepted(self, accepted: dict[tuple[str, int], int]) -> None:
        self.decode.hold_accepted(accepted)

    def kv_groups(self) -> list[dict[str, Any]] | None:
        return self.decode.kv_groups()

    def hit_alignment(self) -> int | None:
        return self.decode.hit_alignment()

    def min_gpu_blocks(self) -> int | None:
        return self.decode.min_gpu_blocks()

    def kv_event_rows(self) -> list[dict[str, Any]] | None:
        return self.decode.kv_event_rows()

    def track_blocks(self, request_ids: set[str]) -> None:
        self.decode.track_blocks(request_ids)

    def evict_cached_blocks(self, request: str | None, group: int | None) -> int:
        return self.decode.evict_cached_blocks(request, group)

    def lookups(self) -> dict[str, tuple[int, int]] | None:
        return self.decode.lookups()

    def forget(self, request_id: str) -> None:
        self.decode.forget(request_id)

    def hits_are_first_prefill(self) -> bool | None:
        return self.decode.hits_are_first_prefill()


class TaggedLog:
    """One instance's view of a pair's shared naming log: what it files is
    appended to the shared list with its tag; its length is the shared one's
    (a row's mark counts every naming before it, either instance's)."""

    def __init__(self, entries: list, tag: str) -> None:
        self.entries, self.tag = entries, tag

    def append(self, entry: tuple[str, int, str]) -> None:
        self.entries.append((*entry, self.tag))

    def __len__(self) -> int:
        return len(self.entries)
