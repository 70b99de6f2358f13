"""A trace as editable requests, with every prompt's tokens in hand.

Shrinking removes requests and events and cuts prompts; doing that on the
Arrow tables would mean rebuilding them by hand at every probe. A
:class:`Case` holds plain tuples instead, and :meth:`Case.to_trace` builds the
trace a probe replays, so each probe replays exactly what it names.
Removing a request keeps the ``after:`` chains valid: its dependants (and
events anchored after it) take over its own anchor; events that target it
are dropped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces import Trace
from traces.model import schema
from traces.model.engine_spec import EngineBlock
from traces.materialize import TokenSource, request_rows
from traces.model.tokens import stream_tokens


@dataclass(frozen=True)
class Req:
    id: str
    prompt: np.ndarray                       # int64 token ids
    output_len: int = 1
    after: str | None = None
    arrival_step: int | None = 0
    cache_salt: str | None = None
    priority: int | None = None
    lora_name: str | None = None
    output_tokens: np.ndarray | None = None  # recorded; None: the null model's out:<id>

    def output(self, vocab: int) -> np.ndarray:
        """The tokens this request's answer holds (what a later turn may quote)."""
        if self.output_tokens is not None:
            return np.asarray(self.output_tokens, dtype=np.int64)
        return stream_tokens(f"out:{self.id}", 0, self.output_len, vocab)


@dataclass(frozen=True)
class Case:
    engine: EngineBlock
    requests: tuple[Req, ...]
    events: tuple[dict[str, Any], ...] = ()
    source: dict[str, Any] = field(default_factory=dict)

    # -- reading ------------------------------------------------------------
    @classmethod
    def from_trace(cls, trace: Trace) -> "Case":
        tokens = TokenSource(trace.header, trace.requests, trace.request_lists)
        rows = request_rows(trace.requests)
        outs = (trace.requests["output_tokens"].to_pylist()
                if "output_tokens" in trace.requests.column_names else None)
        reqs = []
        for i, rid in enumerate(rows.ids):
            prio = rows.priority[i]
            reqs.append(Req(
                id=str(rid), prompt=np.asarray(tokens.prompt(i), dtype=np.int64),
                output_len=int(rows.output_len[i]), after=rows.after[i],
                arrival_step=None if rows.after[i] is not None else int(rows.arrival_step[i] or 0),
                cache_salt=rows.cache_salt[i], priority=prio, lora_name=rows.lora_name[i],
                output_tokens=None if outs is None or outs[i] is None
                else np.asarray(outs[i], dtype=np.int64)))
        tokens.close()
        events = tuple(trace.events.to_pylist()) if trace.events is not None else ()
        return cls(engine=trace.engine, requests=tuple(reqs), events=events,
                   source=dict(trace.header.get("source") or {}))

    # -- sizes --------------------------------------------------------------
    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.requests]

    @property
    def tokens(self) -> int:
        return int(sum(len(r.prompt) for r in self.requests))

    def by_id(self) -> dict[str, Req]:
        return {r.id: r for r in self.requests}

    def key(self) -> str:
        """A digest naming exactly what a probe replays (the probe cache's key)."""
        h = hashlib.sha256()
        h.update(json.dumps(self.engine.to_header(), sort_keys=True).encode())
        for r in self.requests:
            h.update(json.dumps([r.id, r.output_len, r.after, r.arrival_step, r.cache_salt,
                                 r.priority, r.lora_name]).encode())
            h.update(np.asarray(r.prompt, dtype=np.int64).tobytes())
            h.update(b"|" if r.output_tokens is None
                     else np.asarray(r.output_tokens, dtype=np.int64).tobytes())
        h.update(json.dumps(list(self.events), sort_keys=True, default=str).encode())
        return h.hexdigest()

    # -- edits --------------------------------------------------------------
    def with_prompts(self, prompts: dict[str, np.ndarray]) -> "Case":
        return replace(self, requests=tuple(
            replace(r, prompt=prompts[r.id]) if r.id in prompts else r for r in self.requests))

    def with_engine(self, **changes: Any) -> "Case":
        return replace(self, engine=self.engine.with_settings(**changes))

    def without(self, request_ids: set[str] = frozenset(),
                event_indices: set[int] = frozenset()) -> "Case":
        """This case less some requests and events, ``after:`` chains rewired."""
        by_id = self.by_id()

        def anchor(rid: str) -> tuple[str | None, int | None]:
            """Where a removed request's dependants now hang: its own anchor, resolved."""
            r = by_id[rid]
            while r.after is not None and r.after in request_ids:
                r = by_id[r.after]
            return (r.after, None) if r.after is not None else (None, r.arrival_step or 0)

        reqs = []
        for r in self.requests:
            if r.id in request_ids:
                continue
            if r.after is not None and r.after in request_ids:
                after, step = anchor(r.after)
                r = replace(r, after=after, arrival_step=step)
            reqs.append(r)
        events = []
        for i, ev in enumerate(self.events):
            if i in event_indices or ev.get("target") in request_ids:
                continue
            ev = dict(ev)
            if ev.get("keys"):
                keys = [k for k in ev["keys"] if k.get("request") not in request_ids]
                if not keys:
                    continue
                ev["keys"] = keys
            if ev.get("after") is not None and ev["after"] in request_ids:
                after, step = anchor(ev["after"])
                ev["after"], ev["at_step"] = after, (None if after is not None else step)
            events.append(ev)
        return replace(self, requests=tuple(reqs), events=tuple(events))

    # -- writing ------------------------------------------------------------
    def to_trace(self, path: str | Path | None = None) -> Trace:
        """The trace a probe replays (prompt tokens spelled out)."""
        rq = self.requests
        prompts = [np.asarray(r.prompt, dtype=np.int32) for r in rq]
        offsets = np.zeros(len(rq) + 1, dtype=np.int32)
        offsets[1:] = np.cumsum([len(p) for p in prompts])
        cols: dict[str, Any] = {
            "id": pa.array([r.id for r in rq], pa.string()),
            "arrival_step": pa.array([r.arrival_step if r.after is None else None for r in rq],
                                     pa.int64()),
            "after": pa.array([r.after for r in rq], pa.string()),
            "num_prompt_tokens": pa.array([len(p) for p in prompts], pa.int64()),
            "prompt_tokens": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(np.concatenate(prompts), pa.int32())),
            "output_len": pa.array([r.output_len for r in rq], pa.int64()),
            "cache_salt": pa.array([r.cache_salt for r in rq], pa.string()),
            "priority": pa.array([r.priority for r in rq], pa.int64()),
        }
        if any(r.lora_name is not None for r in rq):
            cols["lora_name"] = pa.array([r.lora_name for r in rq], pa.string())
        if any(r.output_tokens is not None for r in rq):
            cols["output_tokens"] = pa.array(
                [None if r.output_tokens is None else [int(t) for t in r.output_tokens]
                 for r in rq], pa.list_(pa.int32()))
        requests = pa.table(cols, schema=schema.REQUESTS.arrow_schema(set(cols)))
        events = (pa.Table.from_pylist([dict(e) for e in self.events],
                                       schema=schema.EVENTS.arrow_schema())
                  if self.events else None)
        header = {"schema_version": schema.SCHEMA_VERSION, "engine": self.engine,
                  "source": {"kind": "authored", "from": "replayer shrink"}}
        return Trace(header=header, requests=requests, events=events,
                     path=None if path is None else Path(path))
