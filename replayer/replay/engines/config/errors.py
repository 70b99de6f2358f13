"""vLLM's own config errors, said in the scenario's terms.

vLLM validates its config classes with pydantic, whose first line is only
"1 validation error for SchedulerConfig". Here each error names the engine
field of the trace it came from (``engine.max_num_batched_tokens``), with
vLLM's own reason, in one line.
"""

from __future__ import annotations

import re
from typing import Any

# (vLLM config class, vLLM field) -> the trace's engine field, where the names differ.
RENAMED = {
    ("CacheConfig", "num_gpu_blocks_override"): "num_gpu_blocks",
    ("CacheConfig", "mamba_block_size"): "kv_groups[mamba].block_size",
    ("SchedulerConfig", "policy"): "scheduling_policy",
    ("SpeculativeConfig", "num_speculative_tokens"): "speculative.num_speculative_tokens",
    ("SpeculativeConfig", "method"): "speculative.method",
    ("SpeculativeConfig", "disable_lookahead_block_hashes"):
        "speculative.disable_lookahead_block_hashes",
}
BUILD_FAILED = "cannot build this engine"


def _engine_keys() -> tuple[str, ...]:
    from traces.model.engine_spec import ENGINE_KEYS

    return tuple(ENGINE_KEYS)


def field_name(cls: str, field: str) -> str:
    """The trace's name for vLLM's ``cls.field`` (``engine.X``), else vLLM's own."""
    if (cls, field) in RENAMED:
        return "engine." + RENAMED[(cls, field)]
    for (_, vllm_name), ours in RENAMED.items():
        if not cls and vllm_name == field:
            return "engine." + ours
    if field in _engine_keys():
        return "engine." + field
    return f"vLLM's {cls}.{field}"


def _mentioned_field(cls: str, text: str) -> str | None:
    """A model-level validator names no field: find one of ours in its message."""
    # ``model`` is an engine key and a word of most of vLLM's messages: never a match here.
    names = sorted((set(_engine_keys()) - {"model"}) | {f for _, f in RENAMED}, key=len,
                   reverse=True)
    for name in names:
        if re.search(rf"\b{re.escape(name)}\b", text):
            return field_name(cls, name)
    return None


def describe(exc: BaseException, version: str) -> str:
    """One line: which engine field vLLM refused and vLLM's reason."""
    errors = getattr(exc, "errors", None)
    cls = getattr(exc, "title", None)
    if callable(errors) and isinstance(cls, str):
        try:
            items: list[dict[str, Any]] = list(errors())
        except Exception:  # noqa: BLE001 - not pydantic after all
            items = []
        if items:
            first = items[0]
            loc = [str(x) for x in first.get("loc", ()) if not isinstance(x, int)]
            reason = " ".join(str(first.get("msg", "")).split())
            reason = reason.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            name = (field_name(cls, loc[0]) if loc else _mentioned_field(cls, reason)
                    or f"vLLM's {cls}")
            more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
            return f"{name}: vLLM {version} {BUILD_FAILED}: {reason}{more}"
    # Not pydantic: vLLM's own sentences name what it needs (a guess could mislead),
    # all of them (cut at a length, one ended mid-sentence: "Try increasing `").
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"vLLM {version} {BUILD_FAILED}: {text}"
