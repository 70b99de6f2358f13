"""Hand-written YAML scenarios: how users write a regression case.

A scenario compiles to an ordinary trace (prompt tokens spelled out), so a
scenario and its compiled trace replay identically. Every key is checked;
unknown keys are errors with the file and the key's place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces.goldens.outcomes import KINDS
from traces.goldens.store import STORE
from traces.io.safe_yaml import load_yaml_file
from traces.model import schema
from traces.model.engine_spec import EngineBlock
from traces.model.errors import MAX_INT, TraceError, reject_unknown_keys, require_int
from traces.model.events import parse_event
from traces.model.limits import MAX_TOKENS, TokenBudget
from traces.model.tokens import stream_tokens
from traces.trace import Trace, validate_trace

TOP_KEYS = ("engine", "requests", "events", "expect", "expect_store", "expect_events",
            "expect_recompute", "description")
REQUEST_KEYS = ("id", "prompt", "output_len", "after", "arrival_step", "cache_salt",
                "priority")
SPAN_KEYS = ("stream", "start", "len")


def is_scenario_path(path: str | Path) -> bool:
    return Path(path).suffix in (".yaml", ".yml")


def load_yaml(path: Path) -> dict[str, Any]:
    data = load_yaml_file(path)      # bounded: size, nesting, aliases, duplicate keys
    if not isinstance(data, dict):
        raise TraceError(path, "a scenario must be a YAML mapping")
    return data


def _unknown(path: Path, where: str, obj: dict[str, Any], known: tuple[str, ...]) -> None:
    reject_unknown_keys(path, where, obj, known)


def _prompt_tokens(path: Path, where: str, prompt: Any, vocab: int,
                   budget: TokenBudget) -> np.ndarray:
    spans = prompt if isinstance(prompt, list) else [prompt]
    if not spans:
        raise TraceError(path, f"{where}.prompt is empty")
    parts = []
    for j, span in enumerate(spans):
        w = f"{where}.prompt[{j}]"
        if not isinstance(span, dict):
            raise TraceError(path, f"{w} must be a mapping {{stream, start, len}}")
        _unknown(path, w, span, SPAN_KEYS)
        stream = span.get("stream")
        if not isinstance(stream, str) or not stream:
            raise TraceError(path, f"{w}.stream must be a non-empty string")
        start = require_int(path, f"{w}.start", span.get("start", 0), 0)
        length = require_int(path, f"{w}.len", span.get("len"), 1, MAX_TOKENS)
        budget.take(path, f"{w}.len", length)
        parts.append(stream_tokens(stream, start, length, vocab))
    return np.concatenate(parts)


def compile_scenario(path: str | Path) -> Trace:
    """Read a scenario file and build its trace (goldens from ``expect:``)."""
    path = Path(path)
    data = load_yaml(path)
    _unknown(path, "the scenario", data, TOP_KEYS)
    engine = EngineBlock.from_dict(str(path), data.get("engine", {}))
    vocab = engine.vocab_size
    reqs = data.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise TraceError(path, "requests must be a non-empty list")
    cols: dict[str, list[Any]] = {k: [] for k in (
        "id", "arrival_step", "after", "num_prompt_tokens", "prompt_tokens", "output_len",
        "cache_salt", "priority")}
    budget = TokenBudget()
    for i, req in enumerate(reqs):
        where = f"requests[{i}]"
        if not isinstance(req, dict):
            raise TraceError(path, f"{where} must be a mapping")
        _unknown(path, where, req, REQUEST_KEYS)
        rid = req.get("id")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise TraceError(path, f"{where}.id must be a string")
        if "prompt" not in req:
            raise TraceError(path, f"{where} has no prompt")
        tokens = _prompt_tokens(path, where, req["prompt"], vocab, budget)
        after = req.get("after")
        if after is not None and "arrival_step" in req:
            raise TraceError(path, f"{where}: give either after or arrival_step, not both")
        cols["id"].append(str(rid))
        cols["arrival_step"].append(None if after is not None
                                    else require_int(path, f"{where}.arrival_step",
                                              req.get("arrival_step", 0), 0))
        cols["after"].append(None if after is None else str(after))
        cols["num_prompt_tokens"].append(len(tokens))
        cols["prompt_tokens"].append(tokens.astype(np.int32))
        cols["output_len"].append(require_int(path, f"{where}.output_len", req.get("output_len", 1), 1,
                                              MAX_TOKENS))
        salt = req.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TraceError(path, f"{where}.cache_salt must be a string")
        cols["cache_salt"].append(salt)
        priority = req.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or abs(priority) > MAX_INT):
            raise TraceError(path, f"{where}.priority must be an integer of at most {MAX_INT}")
        cols["priority"].append(priority)
    spec = schema.REQUESTS
    arrays = {}
    for name, values in cols.items():
        col = next(c for c in spec.columns if c.name == name)
        if name == "prompt_tokens":
            offsets = np.zeros(len(values) + 1, dtype=np.int32)
            offsets[1:] = np.cumsum([len(v) for v in values])
            flat = pa.array(np.concatenate(values), type=pa.int32())
            arrays[name] = pa.ListArray.from_arrays(pa.array(offsets), flat)
        else:
            arrays[name] = pa.array(values, type=col.type)
    requests = pa.table(arrays, schema=spec.arrow_schema(set(cols)))
    events = _events(path, data.get("events"), set(cols["id"]))
    if events is not None:
        _check_store_events(path, events, engine)
    header = {
        "schema_version": schema.SCHEMA_VERSION,
        "engine": engine,
        "source": {"kind": "authored", "from": path.name},
    }
    if data.get("description") is not None:
        header["description"] = str(data["description"])
    expect_recompute = data.get("expect_recompute", False)
    if not isinstance(expect_recompute, bool):
        raise TraceError(path, "expect_recompute must be true or false")
    trace = Trace(header=header, requests=requests, events=events, path=path,
                  expect_recompute=expect_recompute,
                  **_goldens(path, data, engine, set(cols["id"])))
    validate_trace(path, trace)
    return trace


def _check_store_events(path: Path, events: pa.Table, engine: EngineBlock) -> None:
    """Store events need a connector, and a rank they name must be one the engine runs."""
    for i, (action, keys) in enumerate(zip(events["action"].to_pylist(),
                                           events["keys"].to_pylist())):
        if action not in ("store_remove", "store_fault"):
            continue
        if not engine.connector:
            raise TraceError(path, f"events[{i}]: {action} needs engine.connector")
        if engine.connector != "mooncake_store":
            raise TraceError(path, f"events[{i}]: {action} names MooncakeStore keys and its "
                                   f"client; engine.connector {engine.connector} has neither "
                                   "(it needs engine.connector mooncake_store)")
        for j, sel in enumerate(keys or ()):
            if sel.get("rank") is not None and sel["rank"] >= engine.tensor_parallel_size:
                raise TraceError(path, f"events[{i}].keys[{j}].rank {sel['rank']} is not a "
                                       f"rank of this engine (tensor_parallel_size "
                                       f"{engine.tensor_parallel_size})")


def _events(path: Path, events: Any, ids: set[str]) -> pa.Table | None:
    if events is None:
        return None
    if not isinstance(events, list):
        raise TraceError(path, "events must be a list")
    rows = []
    for i, ev in enumerate(events):
        where = f"events[{i}]"
        if not isinstance(ev, dict):
            raise TraceError(path, f"{where} must be a mapping")
        rows.append(parse_event(path, where, ev, ids))
    return pa.Table.from_pylist(rows, schema=schema.EVENTS.arrow_schema())


def _goldens(path: Path, data: dict[str, Any], engine: EngineBlock,
             ids: set[str]) -> dict[str, Any]:
    """Each kind's block: the Trace fields holding {engine key: expectation}."""
    out = {}
    for kind in KINDS:
        raw = data.get(kind.block)
        if kind is STORE and raw is not None and not engine.connector:
            raise TraceError(path, f"{STORE.block} needs engine.connector")
        out[kind.attr] = kind.parse_block(path, raw, ids)
    return out
