"""Checking and updating a replay's store goldens (keys written, lookup hits).

Kept apart from the per-request check so that one module owns the store's
rules: what is compared (see traces.store_goldens), how a difference is told,
and where a rewritten store golden goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traces import store_goldens
from traces.goldens import ANY_ENGINE, select
from traces.trace import Trace, write_golden

from .golden_update import rewrite_scenario_block
from .replay import ReplayResult


def actual(result: ReplayResult) -> dict[str, Any] | None:
    if result.store is None:
        return None
    return store_goldens.from_report(result.store["rows"], result.store["lookups"])


def check(trace: Trace, result: ReplayResult) -> tuple[list[str], bool]:
    """Report lines and whether the store matched (True when there is nothing to check)."""
    got = actual(result)
    chosen = select(trace.store_goldens, result.engine.key)
    if got is None or chosen is None:
        return [], True
    key, expect = chosen
    diffs = store_goldens.compare_store(expect, got)
    label = "any engine" if key == ANY_ENGINE else key
    if not diffs:
        n = sum(len(b) for g in expect.get("puts", {}).values() for b in g.values())
        return [f"  store: {n} key(s) written and {len(expect.get('lookups', {}))} lookup(s) "
                f"match the store goldens for {label}"], True
    lines = [f"  store: {len(diffs)} difference(s) against the store goldens for {label}"]
    lines += [f"    {d.describe()}" for d in diffs]
    return lines, False


def _yaml(expect: dict[str, Any], engine_key: str | None) -> str:
    def body(e: dict[str, Any], indent: str) -> list[str]:
        out = [f"{indent}puts:"]
        for req, groups in e.get("puts", {}).items():
            inner = ", ".join(f"{g}: [{', '.join(str(b) for b in bs)}]" for g, bs in groups.items())
            out.append(f"{indent}  {req}: {{{inner}}}")
        hits = ", ".join(f"{r}: {h}" for r, h in e.get("lookups", {}).items())
        out.append(f"{indent}lookups: {{{hits}}}")
        return out

    lines = ["expect_store:"]
    if engine_key is None:
        lines += body(expect, "  ")
    else:
        lines.append(f'  "{engine_key}":')
        lines += body(expect, "    ")
    return "\n".join(lines) + "\n"


def update(path: Path, is_scenario: bool, trace: Trace, result: ReplayResult) -> str | None:
    """Rewrite the store golden from this replay; returns where, or None without a store."""
    got = actual(result)
    if got is None:
        return None
    engine_key = result.engine.key
    if is_scenario:
        keyed = [k for k in trace.store_goldens if k != ANY_ENGINE]
        if keyed:
            if len(keyed) > 1 or keyed[0] != engine_key:
                raise ValueError(f"{path}: expect_store holds goldens for several engines; "
                                 "edit it by hand")
            text = _yaml(got, engine_key)
        else:
            text = _yaml(got, None)
        rewrite_scenario_block(path, "expect_store", text)
        return f"{path} (expect_store:)"
    return str(write_golden(path, engine_key, store_goldens.to_table(got, engine_key),
                            store=True))
