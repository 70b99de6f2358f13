"""vLLM's KV-cache events, collected in process and named by meaning.

vLLM's scheduler hands each step's ``KVEventBatch`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` from ``kv_cache_manager.take_events()``)
to its ``kv_event_publisher``, which in production is ZMQ. That publisher is
the one seam replaced here: :class:`KvEventCollector` stands in front of it
(the replay's is vLLM's null publisher, configured with
``KVEventsConfig(enable_kv_cache_events=True, publisher="null")``; a live
server's ZMQ publisher still gets every batch), so every event is vLLM's own.

A hash means nothing across hash seeds, so each block becomes a row naming
its KV-cache group (``group_idx``), the token boundary it ends at, and the
first request whose tokens hold that prefix: every block hash vLLM computed
for a request (``Request.block_hashes``, at ``hash_block_size``, each chained
over its whole prefix) is indexed the first time it is seen, in arrival order.
A ``BlockStored`` covers the token range after its parent block; the blocks of
that range vLLM did not keep (sparse Mamba retention, outside a sliding
window) are rows with ``kept`` false, their boundaries read off the request
that emitted the event (the live or just-freed request whose hashes and
tokens match it). Used by the replay's engine and by the recorder alike, so
a recording and its replay name blocks the same way.
"""

from __future__ import annotations

from typing import Any, Callable

from traces.model.schema import KV_EVENTS

COLUMNS = tuple(c.name for c in KV_EVENTS.columns)


def _hex(h: Any) -> str | None:
    if h is None:
        return None
    return h.hex() if isinstance(h, (bytes, bytearray)) else format(int(h), "x")


class _Tee:
    """The publisher vLLM calls: collect, then hand on to the one configured."""

    def __init__(self, collector: "KvEventCollector", inner: Any) -> None:
        self._collector = collector
        self._inner = inner

    def publish(self, events: Any) -> None:
        self._collector.collect(events)
        if self._inner is not None:
            self._inner.publish(events)

    def __getattr__(self, name: str) -> Any:       # shutdown, get_publisher_config, ...
        return getattr(self._inner, name)


class KvEventCollector:
    """Rows of ``kv_events`` for every batch the scheduler publishes.

    ``step`` says the engine step being updated; ``sink`` (optional) receives
    each row as a dict (the recorder's part writer), else rows are kept in
    :attr:`rows`."""

    def __init__(self, scheduler: Any, step: Callable[[], int],
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.scheduler = scheduler
        self.step = step
        self.sink = sink
        self.rows: list[tuple] = []
        cfg = scheduler.kv_cache_config
        # The granularity of Request.block_hashes: the scheduler's own (0.29 on),
        # else the KV-cache config's.
        self.hbs = int(getattr(scheduler, "hash_block_size", 0)
                       or getattr(cfg, "hash_block_size", 0) or scheduler.cache_config.block_size)
        self._ext = _external_hash()
        self.first: dict[Any, tuple[int, str]] = {}      # external hash -> (boundary, request)
        self._indexed: dict[str, int] = {}               # request id -> hashes indexed
        self._freed: list[Any] = []                      # freed since the last publish
        self._order = 0
        # A time segment's (start_name_log): every indexing in order, kept or not,
        # and per row the hash it was named by, the name had it none, and how
        # many indexings preceded it; the head names rows from the exact path's.
        self.name_log: list[tuple[Any, int, str]] | None = None
        self.row_names: list[tuple[Any, tuple, int]] = []
        scheduler.kv_event_publisher = _Tee(self, scheduler.kv_event_publisher)
        free = scheduler._free_request

        def _free_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            # Blocks a request cached in its last update are published after it
            # is freed: keep it (and its hashes) until that publish.
            self._index(request)
            self._freed.append(request)
            return free(request, *args, **kwargs)

        scheduler._free_request = _free_request

    # -- hashes -> meaning --------------------------------------------------
    def _index(self, request: Any) -> None:
        hashes = request.block_hashes
        rid = request.request_id
        done = self._indexed.get(rid, 0)
        if done >= len(hashes):
            return
        first, ext, hbs, log = self.first, self._ext, self.hbs, self.name_log
        for i in range(done, len(hashes)):
            h, site = ext(hashes[i]), ((i + 1) * hbs, rid)
            first.setdefault(h, site)
            if log is not None:
                log.append((h, *site))
        self._indexed[rid] = len(hashes)

    def start_name_log(self) -> None:
        """Log every indexing from now on, for the head (a time segment)."""
        if self.name_log is None:
            self.name_log = []

    def _named(self, h: Any, default: tuple = (None, None)) -> tuple:
        """``h``'s name, as a row takes it (noted for the head in a segment)."""
        if self.name_log is not None:
            self.row_names.append((h, default, len(self.name_log)))
        return self.first.get(h, default)

    def _candidates(self) -> list[Any]:
        return [*self.scheduler.requests.values(), *self._freed]

    def _emitter(self, ev: Any, start: int, end: int, candidates: list[Any]) -> Any:
        """A request whose prefix up to ``end`` is the event's (the one that emitted it,
        or one sharing its tokens)."""
        hbs, ext = self.hbs, self._ext
        last = ev.block_hashes[-1] if ev.block_hashes else None
        last_at = self.first.get(last, (None,))[0] if last is not None else None
        tokens = None
        for req in candidates:
            hashes = req.block_hashes
            if len(hashes) < end // hbs:
                continue
            if start and ext(hashes[start // hbs - 1]) != ev.parent_block_hash:
                continue
            if last_at is not None and ext(hashes[last_at // hbs - 1]) != last:
                continue
            if last_at != end:
                if tokens is None:
                    tokens = list(ev.token_ids)
                if list(req.all_token_ids[start:end]) != tokens:
                    continue
            return req
        return None

    # -- the publisher seam ---------------------------------------------------
    def collect(self, batch: Any) -> None:
        candidates = self._candidates()
        for req in candidates:
            self._index(req)
        step = self.step()
        for ev in batch.events:
            name = type(ev).__name__
            if name == "BlockStored":
                self._stored(ev, step, candidates)
            elif name == "BlockRemoved":
                for h in ev.block_hashes:
                    b, rid = self._named(h)
                    self._row(step, name, ev.group_idx, b, None, rid, h, ev.medium)
            elif name == "AllBlocksCleared":
                if self.name_log is not None:
                    self.row_names.append((None, (None, None), len(self.name_log)))
                self._row(step, name, None, None, None, None, None, None)
        self._freed.clear()

    def _stored(self, ev: Any, step: int, candidates: list[Any]) -> None:
        group, medium, bs = ev.group_idx, ev.medium, ev.block_size
        kept = list(ev.block_hashes)
        parent = ev.parent_block_hash
        start = 0 if parent is None else self.first.get(parent, (None,))[0]
        emitter = None
        if start is not None and len(kept) * bs != len(ev.token_ids):
            # Some blocks of the range were not kept: place them on the request's hashes.
            end = start + len(ev.token_ids)
            emitter = self._emitter(ev, start, end, candidates)
        if emitter is None:
            # Every block kept (or the range cannot be placed): the kept blocks, by hash.
            for h in kept:
                b, rid = self._named(h)
                self._row(step, "BlockStored", group, b, True, rid, h, medium)
            return
        hashes, ext, hbs = emitter.block_hashes, self._ext, self.hbs
        kept_set = set(kept)
        for b in range(start + bs, end + 1, bs):
            h = ext(hashes[b // hbs - 1])
            boundary, rid = self._named(h, (b, emitter.request_id))
            if h in kept_set:
                self._row(step, "BlockStored", group, boundary, True, rid, h, medium)
            else:
                self._row(step, "BlockStored", group, boundary, False, rid, None, medium)

    def _row(self, step: int, event: str, group: Any, boundary: Any, kept: Any,
             request: Any, h: Any, medium: Any) -> None:
        row = (step, self._order, event, group, boundary,
               None if kept is None else (kept or False), request, _hex(h), medium)
        self._order += 1
        if self.sink is not None:
            self.sink(dict(zip(COLUMNS, row)))
        else:
            self.rows.append(row)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(COLUMNS, r)) for r in self.rows]


def _external_hash() -> Callable[[Any], Any]:
    """vLLM's own conversion of a block hash to the form events carry."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # pragma: no cover - every release served has it
        return lambda h: h
    return maybe_convert_block_hash
