"""The shrunk case as a scenario a person reads: roles for ids, spans for prompts.

Prefix caching sees only which prompts share which prefix, so each prompt is
rebuilt from that structure: the earlier request (prompt plus answer) with
which it shares the longest prefix ``l``, that request's spans cut to ``l``,
then a fresh stream of its own for the rest. A prefix reaching into an
earlier answer is a span over ``out:<its new id>``, the stream the null
model answers with. Every pairwise longest common prefix is kept (they form
an ultrametric: the longest-sharing parent decides all the others), never a
raw token list. Requests are named by role: ``turn1..`` the chain whose
prompts extend each other toward the request the property is about,
``sibling1..`` others that share a prefix, ``other1..`` the rest.
"""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import yaml

from replayer.analysis.shrink.case import Case, Req

Span = dict[str, Any]


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def parents(case: Case) -> dict[str, tuple[str, int]]:
    """Each request's earlier request sharing its longest prefix, and that length."""
    vocab = case.engine.vocab_size
    seqs: list[tuple[str, np.ndarray]] = []
    out: dict[str, tuple[str, int]] = {}
    for r in case.requests:
        best = ("", 0)
        for rid, seq in seqs:
            n = _lcp(r.prompt, seq)
            if n > best[1]:
                best = (rid, n)
        if best[1]:
            out[r.id] = best
        seqs.append((r.id, np.concatenate([r.prompt, r.output(vocab)])))
    return out


def roles(case: Case, focus: str | None) -> dict[str, str]:
    """old id -> new id by role (arrival order within each role)."""
    par = parents(case)
    by_id = case.by_id()
    chain: list[str] = []
    cur = focus if focus in by_id else None
    while cur is not None:
        chain.append(cur)
        p = par.get(cur)
        cur = p[0] if p and p[1] >= len(by_id[p[0]].prompt) else None
    sharing = set(par) | {p for p, _ in par.values()}
    names: dict[str, str] = {}
    counts = {"turn": 0, "sibling": 0, "other": 0}
    for r in case.requests:
        role = "turn" if r.id in chain else "sibling" if r.id in sharing else "other"
        counts[role] += 1
        names[r.id] = f"{role}{counts[role]}"
    return names


def _cut(spans: list[Span], n: int) -> list[Span]:
    out, left = [], n
    for s in spans:
        if left <= 0:
            break
        take = min(s["len"], left)
        out.append({**s, "len": take})
        left -= take
    return out


def _merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for s in spans:
        if out and out[-1]["stream"] == s["stream"] \
                and out[-1]["start"] + out[-1]["len"] == s["start"]:
            out[-1] = {**out[-1], "len": out[-1]["len"] + s["len"]}
        else:
            out.append(dict(s))
    return out


def prompt_spans(case: Case, names: dict[str, str]) -> dict[str, list[Span]]:
    """old id -> its prompt as spans over named streams (see the module docstring)."""
    par = parents(case)
    full: dict[str, list[Span]] = {}          # prompt spans plus the answer's
    out: dict[str, list[Span]] = {}
    for r in case.requests:
        new = names[r.id]
        spans: list[Span] = []
        if r.id in par:
            pid, n = par[r.id]
            spans = _cut(full[pid], n)
        rest = len(r.prompt) - sum(s["len"] for s in spans)
        if rest:
            spans.append({"stream": new, "start": 0, "len": rest})
        spans = _merge(spans)
        out[r.id] = spans
        full[r.id] = spans + [{"stream": f"out:{new}", "start": 0, "len": r.output_len}]
    return out


def _flow(obj: Any) -> str:
    return yaml.safe_dump(obj, default_flow_style=True, width=10**9, sort_keys=False).strip()


def _event_yaml(ev: dict[str, Any], names: dict[str, str]) -> str:
    out: dict[str, Any] = {}
    if ev.get("after") is not None:
        out["after"] = names[ev["after"]]
    elif ev.get("at_step") is not None:
        out["at_step"] = int(ev["at_step"])
    out["action"] = ev["action"]
    if ev["action"] == "abort" and ev.get("target") is not None:
        out["target"] = names[ev["target"]]
    if ev["action"] == "evict":
        if ev.get("target") is not None:
            out["request"] = names[ev["target"]]
        if ev.get("group") is not None:
            out["group"] = int(ev["group"])
    if ev["action"] == "store_remove":
        out["keys"] = [{k: (names[v] if k == "request" else v) for k, v in key.items()
                        if v is not None} for key in ev["keys"]]
    return _flow(out)


def _request_yaml(r: Req, names: dict[str, str], spans: list[Span]) -> list[str]:
    lines = [f"  - id: {names[r.id]}"]
    if r.after is not None:
        lines.append(f"    after: {names[r.after]}")
    elif r.arrival_step:
        lines.append(f"    arrival_step: {int(r.arrival_step)}")
    lines.append(f"    prompt: [{', '.join(_flow(s) for s in spans)}]")
    lines.append(f"    output_len: {int(r.output_len)}")
    if r.cache_salt is not None:
        lines.append(f"    cache_salt: {_flow(r.cache_salt)}")
    if r.priority is not None:
        lines.append(f"    priority: {int(r.priority)}")
    return lines


def scenario_yaml(case: Case, names: dict[str, str], description: str) -> str:
    """The scenario text (no goldens: they are written by --update-golden's path)."""
    if any(r.lora_name is not None for r in case.requests):
        raise ValueError("a scenario cannot name a LoRA adapter (lora_name)")
    spans = prompt_spans(case, names)
    text = textwrap.fill(" ".join(description.split()), width=76)
    lines = ["description: >", *("  " + ln for ln in text.splitlines())]
    engine = yaml.safe_dump({"engine": case.engine.to_header()}, default_flow_style=None,
                            sort_keys=False, width=10**9)
    lines += engine.rstrip("\n").splitlines()
    lines.append("requests:")
    for r in case.requests:
        lines += _request_yaml(r, names, spans[r.id])
    if case.events:
        lines.append("events:")
        lines += [f"  - {_event_yaml(ev, names)}" for ev in case.events]
    return "\n".join(lines) + "\n"
