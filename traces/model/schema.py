"""Table schemas of a trace directory: one definition read by writer and reader.

A trace is a directory holding ``header.json`` and these Parquet tables. Every
table is plain Arrow, so polars, DuckDB or pyarrow read it without this package.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# 2: recorded requests carry the fields that change cache reads
# (skip_reading_prefix_cache, mm_inputs); recorded outcomes and finishes their
# step; each recorded part says through which step every table was on disk
# (PART_DURABLE_KEY), and a recording stopped cleanly leaves END_FILE.
# Version 1 traces read as before (no such columns: nulls).
SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)
HEADER_FILE = "header.json"
# Written last by a recorder that stopped cleanly (every table flushed):
# a recording without it was cut short (kill -9, a failed write).
END_FILE = "recording-end.json"
# Parquet metadata key of a recorded part: JSON {table: step}, every row of
# each table for engine steps <= step was on disk when this part was written.
PART_DURABLE_KEY = b"prefix_replayer.durable_through_step"
GOLDEN_DIR = "golden"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    required: bool = True      # must be present in the file
    nullable: bool = False     # may hold nulls
    doc: str = ""
    # Types earlier versions wrote, still read as they are (readers .get() new fields).
    older: tuple[pa.DataType, ...] = ()


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    required: bool = False     # the file must exist

    @property
    def file(self) -> str:
        return f"{self.name}.parquet"

    def arrow_schema(self, present: set[str] | None = None) -> pa.Schema:
        cols = [c for c in self.columns if present is None or c.name in present]
        return pa.schema([pa.field(c.name, c.type, nullable=c.nullable) for c in cols])


REQUESTS = Table("requests", (
    Column("id", pa.string(), doc="request id, unique"),
    Column("arrival_step", pa.int64(), nullable=True,
           doc="engine step at which it arrives; null with `after` or at 0"),
    Column("after", pa.string(), required=False, nullable=True,
           doc="arrives once this request has finished"),
    Column("arrival_ms", pa.int64(), required=False, nullable=True,
           doc="original arrival time (imported traces); arrival_step derives from it"),
    Column("num_prompt_tokens", pa.int64()),
    Column("prompt_tokens", pa.list_(pa.int32()), required=False, nullable=True,
           doc="explicit token ids"),
    Column("prompt_block_ids", pa.list_(pa.int64()), required=False, nullable=True,
           doc="anonymised prompt: block ids, tokens synthesised per block"),
    Column("output_len", pa.int64()),
    Column("output_tokens", pa.list_(pa.int32()), required=False, nullable=True),
    Column("cache_salt", pa.string(), required=False, nullable=True),
    Column("lora_name", pa.string(), required=False, nullable=True),
    Column("priority", pa.int64(), required=False, nullable=True,
           doc="scheduling priority (lower runs first) under engine.scheduling_policy "
               "priority; null: 0"),
    Column("arrival_order", pa.int64(), required=False, nullable=True,
           doc="recorded traces: order of arrival (the reader sorts by it)"),
    Column("external_id", pa.string(), required=False, nullable=True,
           doc="recorded traces: the id vLLM's front end gave the request, before vLLM "
               "appended its random suffix (`cmpl-<X-Request-Id>-<prompt index>` for "
               "/v1/completions; with n > 1 each of the n engine requests is "
               "`<sample index>_cmpl-...`): what the client's response is named by"),
    Column("skip_reading_prefix_cache", pa.bool_(), required=False, nullable=True,
           doc="vLLM's Request.skip_reading_prefix_cache: the request never reads the "
               "prefix cache (prompt_logprobs asked, or set explicitly); null: false"),
    Column("mm_inputs", pa.list_(pa.struct([("identifier", pa.string()),
                                            ("offset", pa.int64()),
                                            ("length", pa.int64())])),
           required=False, nullable=True,
           doc="recorded traces: the request's multimodal items (vLLM's mm_features: hash "
               "identifier and placeholder position), which enter its block hashes; "
               "not replayed (refused in one line)"),
), required=True)

# Recorded traces only, a folder of parts beside ``requests/``: a request's row
# is written when it arrives (so a kill loses no request that was running), its
# output when vLLM frees it. The reader folds these rows into ``requests``.
FINISHES = Table("finishes", (
    Column("id", pa.string(), doc="request id (a row of requests)"),
    Column("output_len", pa.int64()),
    Column("output_tokens", pa.list_(pa.int32()), nullable=True),
    Column("step", pa.int64(), required=False, nullable=True,
           doc="the step whose update freed it (an abort: the step it came before)"),
))

EVENTS = Table("events", (
    Column("after", pa.string(), nullable=True, doc="runs once this request finished"),
    Column("at_step", pa.int64(), nullable=True, doc="runs before this engine step"),
    Column("action", pa.string(),
           doc="reset_prefix_cache | abort | evict | store_remove | store_fault "
               "(traces/model/events.py)"),
    Column("target", pa.string(), required=False, nullable=True,
           doc="request id an abort or evict applies to"),
    Column("group", pa.int64(), required=False, nullable=True,
           doc="evict: vLLM's KV-cache group index"),
    Column("keys", pa.list_(pa.struct([("request", pa.string()), ("group", pa.int64()),
                                       ("boundary", pa.int64()), ("rank", pa.int64())])),
           required=False, nullable=True,
           doc="store_remove, store_fault: keys by meaning (null group/boundary/rank: any)",
           older=(pa.list_(pa.struct([("request", pa.string()), ("group", pa.int64()),
                                      ("boundary", pa.int64())])),)),
    Column("op", pa.string(), required=False, nullable=True,
           doc="store_fault: the store op that fails (put | get | exists | lookup)"),
    Column("code", pa.int64(), required=False, nullable=True,
           doc="store_fault: the Mooncake error code it returns (traces/model/store_codes.py)"),
    Column("times", pa.int64(), required=False, nullable=True,
           doc="store_fault: how many matching keys fail (then it is spent)"),
))

OUTCOMES = Table("outcomes", (
    Column("id", pa.string()),
    Column("num_prompt_tokens", pa.int64()),
    Column("num_cached_tokens", pa.int64()),
    Column("num_local_cached_tokens", pa.int64(), nullable=True),
    Column("num_external_cached_tokens", pa.int64(), nullable=True),
    Column("step", pa.int64(), required=False, nullable=True,
           doc="recorded traces: the step whose output carried these prefill stats"),
))

# What a request's prefill observed: the fields goldens pin, recordings hold and
# replays report (traces.model.outcome.RequestOutcome), in this order.
OUTCOME_FIELDS = tuple(c.name for c in OUTCOMES.columns[1:5])

STEPS = Table("steps", (
    Column("step", pa.int64()),
    Column("id", pa.string()),
    Column("num_scheduled_tokens", pa.int64()),
    Column("num_accepted_tokens", pa.int64(), required=False, nullable=True),
))

STORE_OPS = Table("store_ops", (
    Column("order", pa.int64()),
    Column("step", pa.int64()),
    Column("rank", pa.int64()),
    Column("op", pa.string()),
    Column("key", pa.string(), nullable=True),
    Column("group", pa.int64(), nullable=True),
    Column("boundary", pa.int64(), nullable=True),
    Column("bytes", pa.int64(), nullable=True),
    Column("result", pa.int64(), nullable=True),
    Column("request", pa.string(), required=False, nullable=True,
           doc="first request whose prompt has this key's prefix"),
    Column("loader", pa.string(), required=False, nullable=True,
           doc="get: the request whose load fetched the key"),
    Column("instance", pa.string(), required=False, nullable=True,
           doc="a prefill/decode pair (engine.prefill_instance): prefill or decode, the "
               "instance whose store client made the op; null for one engine, and for an "
               "evict (the pool both instances share makes it); tables written before "
               "it read as all null"),
))

# Golden expectations share the outcome columns; kept apart from recorded
# observations so that updating a golden never rewrites what was recorded.
# A golden may pin only some fields (a scenario's ``expect:``): nulls mean "not checked".
GOLDEN = Table("golden", (OUTCOMES.columns[0],) + tuple(
    Column(c.name, c.type, nullable=True) for c in OUTCOMES.columns[1:5]))

# The KV-cache events vLLM publishes (BlockStored / BlockRemoved /
# AllBlocksCleared, what routers such as llm-d and Dynamo consume), one row per
# block: its hash named by meaning (group, token boundary, first request), so a
# stream compares across hash seeds. See replayer/replay/kv_events.py.
KV_EVENTS = Table("kv_events", (
    Column("step", pa.int64(), doc="engine step (schedule() calls before it) whose "
                                   "update_from_output published the batch"),
    Column("order", pa.int64(), doc="position in the published stream"),
    Column("event", pa.string(), doc="BlockStored | BlockRemoved | AllBlocksCleared"),
    Column("group", pa.int64(), nullable=True, doc="KV-cache group (vLLM's group_idx)"),
    Column("boundary", pa.int64(), nullable=True,
           doc="token boundary the block ends at; null for AllBlocksCleared"),
    Column("kept", pa.bool_(), nullable=True,
           doc="BlockStored: true for a block vLLM kept, false for one inside the event's "
               "token range it did not keep (sparse Mamba retention, outside a window); "
               "else null"),
    Column("request", pa.string(), required=False, nullable=True,
           doc="first request whose tokens hold this block's prefix"),
    Column("hash", pa.string(), required=False, nullable=True,
           doc="the block hash, hex (null for a block not kept, or anonymised)"),
    Column("medium", pa.string(), required=False, nullable=True, doc="GPU, CPU, ..."),
))

TABLES = {t.name: t for t in (REQUESTS, EVENTS, OUTCOMES, STEPS, STORE_OPS, KV_EVENTS)}

EVENT_ACTIONS = ("reset_prefix_cache", "abort", "evict", "store_remove", "store_fault")

# Store goldens: which keys each request's prefix got written under, by group
# and token boundary, and what each lookup hit. One table per engine.
GOLDEN_STORE = Table("golden_store", (
    Column("kind", pa.string(), doc="put | get | lookup"),
    Column("request", pa.string(), doc="put: the key's first request; get: the loader"),
    Column("group", pa.int64(), nullable=True),
    Column("boundary", pa.int64(), nullable=True, doc="put: token boundary of the key"),
    Column("hit_length", pa.int64(), nullable=True,
           doc="lookup: tokens the store had (null: never looked up)"),
    Column("rank", pa.int64(), required=False, nullable=True,
           doc="put/get: the worker rank whose own keys these are (null: all ranks')"),
))

# KV-event goldens: per section (stored, skipped, removed) one row per first
# request, group and boundary with how many times; plus one ``cleared`` row
# counting AllBlocksCleared. One table per engine (traces.goldens.events).
GOLDEN_EVENTS = Table("golden_events", (
    Column("kind", pa.string(), doc="stored | skipped | removed | cleared"),
    Column("request", pa.string(), nullable=True),
    Column("group", pa.int64(), nullable=True),
    Column("boundary", pa.int64(), nullable=True),
    Column("count", pa.int64(), doc="how many times; cleared: AllBlocksCleared events"),
))
