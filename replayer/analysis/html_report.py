"""``replayer report``: one self-contained HTML page to look at (no network).

plotly draws the figures; plotly.js is embedded once in the page
(``include_plotlyjs=True``), so the file opens offline, in CI's headless
Chromium as on a laptop. A few lines of script count the figures plotly
rendered and any error the page raised, on ``<body data-figures data-errors>``,
so a test can read them back from the DOM after the scripts ran.
"""

from __future__ import annotations

import html
from typing import Any

import polars as pl

from replayer.analysis.explain import CAUSES, Explanation
from replayer.analysis.explain_tables import beside_the_causes, store_miss_line

BUCKETS = 40

_PROBE = """
<script>
window.__errors = [];
window.addEventListener("error", function (e) { window.__errors.push(String(e.message)); });
window.addEventListener("load", function () {
  setTimeout(function () {
    var figs = 0;
    document.querySelectorAll(".js-plotly-plot").forEach(function (d) {
      if (d.querySelector(".main-svg")) { figs += 1; }
    });
    document.body.setAttribute("data-figures", String(figs));
    document.body.setAttribute("data-errors", String(window.__errors.length));
    document.body.setAttribute("data-error-text", window.__errors.join(" | "));
  }, 500);
});
</script>
"""


def _time_axis(ex: Explanation, trace_header: dict[str, Any]) -> tuple[pl.Series, str]:
    step_ms = (trace_header.get("step_clock") or {}).get("step_ms")
    steps = ex.table["arrival_step"]
    if step_ms:
        return steps * step_ms / 1000.0, "trace time (s, arrival)"
    return steps, "arrival step"


def _figures(ex: Explanation, trace_header: dict[str, Any],
             sweep: dict[str, Any] | None) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    figs = [("hit-rate-over-time", _hit_rate_over_time(go, ex, trace_header)),
            ("reachable-vs-actual", _reachable_vs_actual(go, ex.table)),
            ("lost-by-cause", _lost_by_cause(go, ex)),
            ("per-group-hits", _per_group_hits(go, ex))]
    return figs + (_sweep_figures(go, sweep) if sweep else [])


def _hit_rate_over_time(go: Any, ex: Explanation, trace_header: dict[str, Any]) -> Any:
    x, label = _time_axis(ex, trace_header)
    frame = ex.table.with_columns(x.alias("t"))
    n = max(1, min(BUCKETS, frame.height))
    lo, hi = float(frame["t"].min()), float(frame["t"].max())
    width = (hi - lo) / n or 1.0
    b = (frame.with_columns(((pl.col("t") - lo) / width).floor().clip(0, n - 1).alias("b"))
         .group_by("b").agg(pl.col("num_prompt_tokens").sum(), pl.col("actual").sum(),
                            pl.col("reachable").sum())
         .sort("b").with_columns((lo + (pl.col("b") + 0.5) * width).alias("mid")))
    fig = go.Figure()
    fig.add_scatter(x=b["mid"].to_list(), y=(b["reachable"] / b["num_prompt_tokens"]).to_list(),
                    name="reachable (infinite cache)", mode="lines+markers")
    fig.add_scatter(x=b["mid"].to_list(), y=(b["actual"] / b["num_prompt_tokens"]).to_list(),
                    name="actual (vLLM)", mode="lines+markers")
    fig.update_layout(title="Prefix-cache hit rate over the trace", xaxis_title=label,
                      yaxis_title="hit rate (tokens)", yaxis_tickformat=".0%")
    return fig


def _reachable_vs_actual(go: Any, t: pl.DataFrame) -> Any:
    fig = go.Figure()
    top = max(1, int(t["reachable"].max() or 1))
    fig.add_scatter(x=[0, top], y=[0, top], mode="lines", name="actual = reachable",
                    line={"dash": "dot", "color": "grey"})
    fig.add_scatter(x=t["reachable"].to_list(), y=t["actual"].to_list(), mode="markers",
                    name="request", text=t["id"].to_list(), marker={"size": 6, "opacity": 0.6})
    fig.update_layout(title="Reachable vs actual hit per request (tokens)",
                      xaxis_title="reachable", yaxis_title="actual")
    return fig


def _lost_by_cause(go: Any, ex: Explanation) -> Any:
    totals = ex.totals()
    fig = go.Figure(go.Bar(x=list(CAUSES), y=[totals[c] for c in CAUSES],
                           hovertext=[ex.evidence[c] for c in CAUSES]))
    fig.update_layout(title="Lost tokens by cause (reachable - actual)", yaxis_title="tokens")
    return fig


def _per_group_hits(go: Any, ex: Explanation) -> Any:
    groups = ex.baseline.kv_groups or [{"group": 0, "kind": "full_attention"}]
    by_id = ex.baseline.by_id()
    per_group = [0] * len(groups)
    for rid in ex.table["id"].to_list():
        r = by_id[rid]
        hits = r.group_hits or [r.num_cached_tokens or 0] * len(groups)
        for g, h in enumerate(hits):
            per_group[g] += int(h)
    names = [f"group {g['group']} ({g['kind']})" for g in groups]
    fig = go.Figure()
    fig.add_bar(x=names, y=per_group, name="what the group alone could serve")
    fig.add_bar(x=names, y=[int(ex.table["actual"].sum())] * len(groups),
                name="actual hit (all groups)")
    fig.update_layout(title="Per-group hits (vLLM's find_longest_cache_hit_per_group)",
                      yaxis_title="tokens", barmode="group")
    return fig


def _sweep_figures(go: Any, sweep: dict[str, Any]) -> list[tuple[str, Any]]:
    """One figure per swept key: hit rate against it, a line per setting of the others."""
    figs = []
    for key in sweep["grid"]:
        others = [k for k in sweep["grid"] if k != key]
        fig = go.Figure()
        series: dict[str, list[dict[str, Any]]] = {}
        for row in sweep["rows"]:
            name = ", ".join(f"{k.removeprefix('engine.')}={row[k]}" for k in others)
            series.setdefault(name or "hit rate", []).append(row)
        for name, rows in series.items():
            fig.add_scatter(x=[r[key] for r in rows], y=[r["hit_rate"] for r in rows],
                            mode="lines+markers", name=name)
        fig.update_layout(title=f"Sweep: hit rate against {key.removeprefix('engine.')}",
                          xaxis_title=key.removeprefix("engine."), yaxis_title="hit rate",
                          yaxis_tickformat=".0%", xaxis_type="category")
        figs.append((f"sweep-{key.removeprefix('engine.')}", fig))
    return figs


def _notes(ex: Explanation) -> str:
    """What loses no token or names a loss's key, as ``explain`` prints it: prefixes
    shared below one unit, attention refetched from the store while resident,
    and the store keys each store loss missed."""
    lines = beside_the_causes(ex)
    misses = [f"{rid}: {store_miss_line(ex, rid)}" for rid in ex.store_misses]
    if misses:
        lines.append(f"store misses by group and boundary ({len(misses)} request(s)):")
        lines += [f"  {m}" for m in misses]
    if not lines:
        return ""
    items = "".join(f'<li class="{"sub" if line.startswith("  ") else "head"}">'
                    f"{html.escape(line.strip())}</li>" for line in lines)
    return f'<section id="beside-the-causes"><h2>Beside the causes</h2><ul>{items}</ul></section>'


def render_html(ex: Explanation, target: str, trace_header: dict[str, Any],
                sweep: dict[str, Any] | None = None) -> str:
    s = ex.summary()
    parts = []
    for i, (name, fig) in enumerate(_figures(ex, trace_header, sweep)):
        fig.update_layout(height=420, margin={"t": 60, "b": 50, "l": 60, "r": 20})
        parts.append(f'<section id="{name}">' + fig.to_html(
            full_html=False, include_plotlyjs=(i == 0), div_id=f"fig-{name}",
            config={"displaylogo": False}) + "</section>")
    lost = "".join(f"<tr><td>{c}</td><td>{s['lost'][c]}</td><td>{html.escape(ex.evidence[c])}"
                   "</td></tr>" for c in CAUSES)
    head = (f"<h1>Where did the hits go: {html.escape(target)}</h1>"
            f"<p>engine {html.escape(ex.baseline.engine.label)}; {s['requests']} requests, "
            f"{s['prompt_tokens']} prompt tokens; reachable {s['reachable']} "
            f"({s['reachable_rate']:.1%}), actual {s['actual']} ({s['hit_rate']:.1%}); "
            f"prefix-match unit {ex.unit}, hit alignment {ex.hit_alignment}</p>"
            f"<table><tr><th>cause</th><th>lost tokens</th><th>evidence</th></tr>{lost}</table>"
            + _notes(ex))
    style = ("<style>body{font-family:sans-serif;margin:24px;max-width:1100px}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
             "padding:3px 6px;text-align:left}section{margin-top:18px}"
             "li.sub{margin-left:1.5em;list-style:circle}</style>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>prefix-replayer report"
            f"</title>{style}{_PROBE}</head><body>{head}{''.join(parts)}</body></html>\n")
