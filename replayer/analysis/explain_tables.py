"""The text of ``replayer explain``: per-request table, totals by cause, top losers."""

from __future__ import annotations

import os

import polars as pl

from replayer.analysis.explain import CAUSES, Explanation
from traces.model.gaps import explain_groups
from traces.io.atomic import write_atomic

TABLE_ROWS = 20


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def request_frame(ex: Explanation) -> pl.DataFrame:
    """The table people read: causes that lost nothing in this trace are left out."""
    totals = ex.totals()
    shown = [c for c in CAUSES if totals[c] or c == "unexplained"]
    t = ex.table
    return t.select(
        pl.col("id").alias("request"), pl.col("arrival_step").alias("arrived"),
        pl.col("num_prompt_tokens").alias("prompt"), "reachable", "actual",
        (pl.col("reachable") - pl.col("actual")).alias("lost"),
        *[pl.col(f"lost_{c}").alias(c) for c in shown])


def render(ex: Explanation, top: int = 5, rows: int = TABLE_ROWS) -> str:
    out = []
    with pl.Config(tbl_rows=rows, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, tbl_formatting="ASCII_FULL_CONDENSED",
                   tbl_width_chars=200, tbl_cols=-1):
        out.append(str(request_frame(ex)))
    s = ex.summary()
    lost = s["reachable"] - s["actual"]
    out.append("")
    out.append(f"engine {ex.baseline.engine.label}: {s['requests']} requests, "
               f"{s['prompt_tokens']} prompt tokens; reachable {s['reachable']} "
               f"({_pct(s['reachable'], s['prompt_tokens'])}), actual {s['actual']} "
               f"({_pct(s['actual'], s['prompt_tokens'])}), lost {lost}")
    out.append(f"prefix-match unit {ex.unit}, vLLM's hit alignment {ex.hit_alignment} tokens")
    out.append("replays:")
    for r in ex.replays:
        rs = r["summary"]
        out.append(f"  {r['change']}: hit rate {rs['hit_rate']:.1%}, {rs['steps']} steps")
    out.append("lost tokens by cause (share of lost; evidence):")
    width = max(len(c) for c in CAUSES)
    for c in CAUSES:
        n = s["lost"][c]
        out.append(f"  {c:<{width}}  {n:>10}  {_pct(n, lost) if n else '':>6}  "
                   f"{ex.evidence[c]}")
    out += beside_the_causes(ex)
    worst = (ex.table.with_columns((pl.col("reachable") - pl.col("actual")).alias("lost"))
             .filter(pl.col("lost") != 0)
             .sort(["lost", "arrival_step"], descending=[True, False]).head(top))
    if worst.height:
        out.append(f"top {worst.height} request(s) by lost tokens:")
    by_id = ex.baseline.by_id()
    for r in worst.iter_rows(named=True):
        causes = ", ".join(f"{c} {r[f'lost_{c}']}" for c in CAUSES if r[f"lost_{c}"])
        src = f" (from {r['reachable_from']})" if r["reachable_from"] else ""
        out.append(f"  {r['id']}: reachable {r['reachable']}{src}, actual {r['actual']}, "
                   f"lost {r['lost']}: {causes}")
        why = explain_groups(by_id.get(r["id"]), ex.baseline.kv_groups)
        if why:
            out.append(f"    why: {why}")
        if r["id"] in ex.store_misses:
            out.append(f"    store: {store_miss_line(ex, r['id'])}")
        if r["id"] in ex.mamba_short:
            low, need = ex.mamba_short[r["id"]]
            out.append(f"    {need - low} of its sparse_retention: on the last replay "
                       f"({ex.replays[-1]['change']}) the Mamba groups had state up to {low} "
                       f"of the {need} it shares: none was written at {need} (only where a "
                       "prefill chunk ended, or at a junction a lookup found first)")
    return "\n".join(out)


def _kinds(ex: Explanation) -> dict[int, str]:
    return {g["group"]: g["kind"] for g in (ex.baseline.kv_groups or [])}


def below_unit_line(ex: Explanation, rid: str) -> str:
    """Why a request that shares a prefix has a reachable hit of 0."""
    shared, src = ex.below_unit[rid]
    unit = (f"one block of {ex.block_size}" if ex.unit == ex.block_size else
            f"one unit of {ex.unit} (the prefix-match unit; block {ex.block_size})")
    return f"shared prefix of {shared} tokens (with {src}) is below {unit}"


def store_miss_line(ex: Explanation, rid: str) -> str:
    """The keys a request's store loss missed, by group and boundary."""
    return "; ".join(m.said(_kinds(ex)) for m in ex.store_misses[rid])


def refetch_line(ex: Explanation, rid: str) -> str:
    r = ex.refetched[rid]
    kinds = _kinds(ex)
    groups = ", ".join(f"group {g} ({kinds.get(g, '?')}) alone held {r.resident[g]}"
                       for g in r.groups)
    return (f"{r.tokens} tokens ({r.bytes} bytes) fetched from the store while resident "
            f"locally: {groups}; the local hit was {r.local}")


def beside_the_causes(ex: Explanation) -> list[str]:
    """Lines for what loses no token: prefixes shared below one unit, and with a
    connector the attention the store fetched again while it was resident."""
    out = []
    if ex.below_unit:
        out.append(f"shared below one unit ({len(ex.below_unit)} request(s), reachable 0, "
                   "nothing vLLM can hit: a hit is whole units):")
        out += [f"  {rid}: {below_unit_line(ex, rid)}" for rid in ex.below_unit]
    if ex.engine.connector:
        tokens = sum(r.tokens for r in ex.refetched.values())
        nbytes = sum(r.bytes for r in ex.refetched.values())
        out.append(f"refetched: {tokens} tokens, {nbytes} bytes in {len(ex.refetched)} "
                   "request(s) (a cost, not lost tokens: attention blocks fetched from the "
                   "store while resident locally, where the local hit, which every group "
                   "must agree on, stopped below them)")
        out += [f"  {rid}: {refetch_line(ex, rid)}" for rid in ex.refetched]
    return out


def write_parquet_atomic(path: str | os.PathLike, frame: pl.DataFrame) -> None:
    """Write ``frame`` so that ``path`` is either untouched or complete."""
    write_atomic(path, lambda tmp: frame.write_parquet(tmp))
