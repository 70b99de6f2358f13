"""Bounds on every input, checked before anything is allocated.

A trace or scenario may come from anywhere; whatever it holds, reading it ends
in a result or in one :class:`TraceError` line within seconds, never in a
hang, an exhausted memory or a traceback. The loaders (scenario YAML,
header.json, Mooncake JSONL, engine blocks, request tables) call these
helpers; the bounds themselves live here, in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from traces.model.errors import MAX_INT, TraceError, require_int, short  # noqa: F401 - MAX_INT re-exported

# Files.
MAX_YAML_BYTES = 8 << 20            # a scenario is written by hand: kilobytes
MAX_JSON_BYTES = 1 << 20            # header.json
MAX_JSONL_LINE_BYTES = 16 << 20     # one Mooncake line (1M block ids is 512M tokens)
MAX_NESTING = 64                    # mappings and lists inside each other
MAX_YAML_EXPANDED = 32_000_000     # values + characters after alias expansion (billion laughs)

# Values.
# MAX_INT (2**62): any integer field, in traces.model.errors.require_int
MAX_TOKENS = 1 << 24                # one request's prompt or output, and max_model_len
MAX_SCENARIO_TOKENS = 1 << 25       # all prompts of a scenario (spelled out as int32)
MAX_BLOCK_TOKENS = 1 << 20          # block_size, prefix_match_unit, prompt_blocks.block_tokens
MAX_GPU_BLOCKS = 1 << 22            # vLLM builds a Python object per block: ~1 GB here
MAX_VOCAB = 2**31 - 1               # tokens are int32
MAX_IMPORT_BLOCK_IDS = 1 << 25      # block ids held while importing (~1 GB of Python ints)
MAX_HASH_SEED = 4294967295          # what Python accepts in PYTHONHASHSEED


check_int = require_int      # an integer in [minimum, maximum]; bools are not integers


def check_hash_seed(path: Any, value: Any) -> None:
    """``hash_seed`` as Python reads PYTHONHASHSEED: 'random' or 0..4294967295."""
    if value is None or value == "random":
        return
    text = str(value) if not isinstance(value, bool) else "x"
    if not text.isascii() or not text.isdigit() or int(text) > MAX_HASH_SEED:
        raise TraceError(path, "engine.hash_seed must be null, 'random' or an integer "
                               f"0..{MAX_HASH_SEED} (as PYTHONHASHSEED), got {short(value)}")


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """A file's bytes, refused past ``limit`` without reading the rest."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "cannot read (is a directory, not a file)") from None
    except OSError as exc:
        raise TraceError(path, f"cannot read ({exc.strerror})") from None
    if len(data) > limit:
        raise TraceError(path, f"larger than {limit >> 20} MiB; a {what} is never this big")
    return data


def decode_utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def load_json(path: Path, data: bytes | str, *, row: int | None = None) -> Any:
    """``json.loads`` whose every failure is one TraceError (depth, digits, encoding)."""
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        at = f" at line {exc.lineno} column {exc.colno}" if row is None else ""
        raise TraceError(path, f"invalid JSON ({exc.msg}{at})", row=row) from None
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"not UTF-8 text (byte {exc.start}: {exc.reason})",
                         row=row) from None
    except RecursionError:
        raise TraceError(path, "invalid JSON (nested too deeply)", row=row) from None
    except ValueError as exc:   # e.g. an integer of more than 4300 digits
        raise TraceError(path, f"invalid JSON ({str(exc).splitlines()[0][:80]})",
                         row=row) from None
    check_nesting(path, value, row=row)
    return value


def check_nesting(path: Path, value: Any, *, row: int | None = None) -> None:
    """Refuse JSON-like data nested deeper than MAX_NESTING (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > MAX_NESTING:
            raise TraceError(path, f"nested deeper than {MAX_NESTING} levels", row=row)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def jsonl_lines(path: Path, fh: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a JSON-lines stream, never holding a line past the limit."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_JSONL_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_JSONL_LINE_BYTES:
            raise TraceError(path, f"line longer than {MAX_JSONL_LINE_BYTES >> 20} MiB",
                             row=lineno)
        yield lineno, raw
        lineno += 1


class TokenBudget:
    """Prompt tokens a scenario spells out, counted before each span is built."""

    def __init__(self, limit: int = MAX_SCENARIO_TOKENS) -> None:
        self.limit = limit
        self.used = 0

    def take(self, path: Any, where: str, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise TraceError(path, f"{where}: the prompts add up to more than {self.limit} "
                                   "tokens, the most a scenario may spell out")


# Engine fields with a tighter bound than MAX_INT: what they cost to build.
ENGINE_BOUNDS = {"block_size": MAX_BLOCK_TOKENS, "prefix_match_unit": MAX_BLOCK_TOKENS,
                 "max_model_len": MAX_TOKENS, "max_num_batched_tokens": MAX_TOKENS,
                 "long_prefill_token_threshold": MAX_TOKENS, "max_num_seqs": 1 << 20,
                 "num_gpu_blocks": MAX_GPU_BLOCKS, "vocab_size": MAX_VOCAB,
                 "prefix_cache_retention_interval": MAX_TOKENS}
CONNECTOR_FLAGS = ("load_async", "lookup_async", "save_decode_cache", "enable_lookup",
                   "enable_group_semantics")


def check_engine_bounds(path: Any, engine: dict[str, Any]) -> None:
    """Engine sizes a replay can build in bounded memory, and a usable hash seed."""
    for key, limit in ENGINE_BOUNDS.items():
        if engine.get(key) is not None:
            check_int(path, f"engine.{key}", engine[key], 0, limit)
    groups = engine.get("kv_groups")
    for i, g in enumerate(groups if isinstance(groups, list) else ()):
        if not isinstance(g, dict):
            continue                    # reported by the engine block's own check
        for key in ("block_size", "sliding_window"):
            if key in g:
                check_int(path, f"engine.kv_groups[{i}].{key}", g[key], 1,
                          MAX_BLOCK_TOKENS if key == "block_size" else MAX_TOKENS)
    spec = engine.get("speculative")
    if isinstance(spec, dict) and "num_speculative_tokens" in spec:
        check_int(path, "engine.speculative.num_speculative_tokens",
                  spec["num_speculative_tokens"], 1, 64)
    check_hash_seed(path, engine.get("hash_seed"))
    config = engine.get("connector_config")
    for key, value in (config.items() if isinstance(config, dict) else ()):
        if key in CONNECTOR_FLAGS and not isinstance(value, bool):
            raise TraceError(path, f"engine.connector_config.{key} must be true or false, "
                                   f"got {short(value)}")
        if key == "cache_prefix" and not isinstance(value, str):
            raise TraceError(path, "engine.connector_config.cache_prefix must be a string")
