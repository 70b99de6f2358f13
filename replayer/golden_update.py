"""``--update-golden``: the only path by which goldens change.

A trace directory gets ``golden/<engine>.parquet`` replaced atomically. A
scenario gets its ``expect:`` block rewritten in place (the rest of the file,
comments included, is kept byte for byte), again atomically.
"""

from __future__ import annotations

import re
from pathlib import Path

from traces.goldens import (ANY_ENGINE, EXPECT_FIELDS, Goldens, expect_from_results,
                           table_from_expect)
from traces.outcome import RequestOutcome
from traces.trace import write_golden

from .report import write_atomic

_TOP_KEY = re.compile(r"^[^\s#]")


def updated_goldens(goldens: Goldens, golden_key: str,
                    results: list[RequestOutcome]) -> dict[str, dict[str, int]]:
    """New expectations for ``golden_key``: same requests and fields as before
    where there were some, else ``num_cached_tokens`` of every request."""
    by_id = {r.id: r for r in results}
    old = goldens.get(golden_key)
    if not old:
        # Where a store served hits, the split between GPU and store is the point.
        fields = ["num_cached_tokens"]
        if any(r.num_external_cached_tokens for r in results):
            fields += ["num_local_cached_tokens", "num_external_cached_tokens"]
        return {r.id: {f: getattr(r, f) for f in fields} for r in results}
    return {rid: {f: getattr(by_id[rid], f) for f in fields} for rid, fields in old.items()
            if rid in by_id}


def _expect_yaml(goldens: Goldens) -> str:
    def entry(fields: dict[str, int]) -> str:
        ordered = [f for f in EXPECT_FIELDS if f in fields]
        return "{" + ", ".join(f"{f}: {fields[f]}" for f in ordered) + "}"

    out = ["expect:"]
    if set(goldens) == {ANY_ENGINE}:
        for rid, fields in goldens[ANY_ENGINE].items():
            out.append(f"  {rid}: {entry(fields)}")
    else:
        for key in sorted(goldens):
            out.append(f'  "{key}":')
            for rid, fields in goldens[key].items():
                out.append(f"    {rid}: {entry(fields)}")
    return "\n".join(out) + "\n"


def rewrite_scenario_expect(path: Path, goldens: Goldens) -> None:
    rewrite_scenario_block(path, "expect", _expect_yaml(goldens))


def rewrite_scenario_block(path: Path, name: str, block: str) -> None:
    """Replace the top-level ``name:`` block of a YAML file (or append it)."""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if re.match(rf"^{name}\s*:", ln)), None)
    if start is None:
        text = "".join(lines)
        if text and not text.endswith("\n"):
            text += "\n"
        write_atomic(path, text + block)
        return
    end = start + 1
    while end < len(lines) and not _TOP_KEY.match(lines[end]):
        end += 1
    # Keep trailing comment/blank lines that belong to whatever follows.
    while end - 1 > start and lines[end - 1].strip() == "":
        end -= 1
    write_atomic(path, "".join(lines[:start]) + block + "".join(lines[end:]))


def update(trace_path: Path, is_scenario: bool, goldens: Goldens, golden_key: str,
           engine_key: str, results: list[RequestOutcome]) -> tuple[str, str]:
    """Write new goldens; returns (the golden key written, where it went)."""
    if is_scenario:
        key = golden_key if golden_key in goldens else (
            ANY_ENGINE if not goldens or ANY_ENGINE in goldens else engine_key)
        new = dict(goldens)
        new[key] = updated_goldens(goldens, key, results)
        rewrite_scenario_expect(trace_path, new)
        return key, f"{trace_path} (expect:)"
    target = write_golden(trace_path, engine_key,
                          table_from_expect(expect_from_results(results), engine_key))
    return engine_key, str(target)
