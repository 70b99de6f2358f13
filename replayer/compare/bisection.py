"""``replayer bisect``: the first engine whose outcome differs from a good one.

The engines form a line, oldest first: the releases from ``--good`` to
``--bad`` (:func:`~replayer.replay.engines.sources.releases.releases_between`: a fixed list of
published releases, never a registry scan), or the commits of a source tree
along its first-parent line (``--tree PATH``; each commit is written out with
``git archive`` into a directory of its own, so the checkout is never
touched, and kept in the cache by commit id, so no later bisect exports or
compiles it again: :func:`~replayer.replay.engines.sources.trees.commit_sources`). Good and
bad are replayed first: good's outcome is the reference, and bad must differ
from it or there is nothing to find. Then a binary search
replays the middle of the open range until the first differing engine sits
next to the last matching one, so a line of n engines costs about
``2 + log2(n)`` replays. "Differs" is :func:`replayer.compare.outcomes.compare_results`,
the rule ``diff`` uses, read through a predicate (``--on``): ``any`` (the
default: an outcome or, with a connector, a store key or lookup), ``outcomes``
(cached tokens and their local/external split only) or ``store`` (keys written
on one side only, lookups whose hit differs; :mod:`replayer.compare.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from replayer.compare.outcomes import EngineDiff, compare_results
from replayer.replay.engines import EngineError, EngineInfo
from replayer.replay.loop import ReplayResult

# --on: which differences make an engine "differ from good"
PREDICATES: dict[str, Callable[[EngineDiff], bool]] = {
    "any": lambda d: d.identical,
    "outcomes": lambda d: d.outcomes_identical,
    "store": lambda d: d.store_identical,
}


@dataclass(frozen=True)
class Probe:
    """One engine tried: its place on the line, who it is, and how it compared."""

    index: int
    role: str                  # good | bad | try
    engine: EngineInfo
    cached_tokens: int
    matched_good: bool
    store_keys: int | None = None   # distinct keys written (None: no connector)


@dataclass
class BisectResult:
    line: int                              # engines on the line, good and bad included
    path: list[Probe] = field(default_factory=list)
    first_bad: Probe | None = None         # None: bad matched good, nothing to find
    change: EngineDiff | None = None       # last matching engine vs first differing one


def _store_keys(res: ReplayResult) -> int | None:
    if res.store is None:
        return None
    return len({r["key"] for r in res.store["rows"]
                if r["op"] == "put" and r["result"] is not None and r["result"] >= 0})


def search(candidates: Sequence[Any], replay_one: Callable[[Any], ReplayResult],
           on_probe: Callable[[Probe], None] | None = None, on: str = "any") -> BisectResult:
    """Binary search over ``candidates`` (good first, bad last) for the first that differs.

    ``on`` names the predicate (:data:`PREDICATES`). ``on_probe`` hears of each
    engine as soon as it is replayed (a replay on a release takes 10-35 s, so
    the command line prints each as it comes)."""
    if len(candidates) < 2:
        raise EngineError("bisect needs a good and a different bad engine")
    if on not in PREDICATES:
        raise EngineError(f"bisect --on {on}: not one of {', '.join(PREDICATES)}")
    matches = PREDICATES[on]
    out = BisectResult(line=len(candidates))
    results: dict[int, ReplayResult] = {}

    def probe(i: int, role: str) -> bool:
        res = replay_one(candidates[i])
        results[i] = res
        same = i == 0 or matches(compare_results(results[0], res))
        out.path.append(Probe(i, role, res.engine, res.summary()["cached_tokens"], same,
                              _store_keys(res)))
        if on_probe is not None:
            on_probe(out.path[-1])
        return same

    probe(0, "good")
    if probe(len(candidates) - 1, "bad"):
        return out
    lo, hi = 0, len(candidates) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid, "try"):
            lo = mid
        else:
            hi = mid
    out.first_bad = next(p for p in out.path if p.index == hi)
    out.change = compare_results(results[lo], results[hi])
    return out


def release_line(good: str, bad: str) -> list[str]:
    """Release specs from ``good`` to ``bad`` (both ``vllm==X.Y.Z``), in that direction."""
    from replayer.replay.engines.sources.releases import releases_between, version_key
    from replayer.replay.engines.sources.specs import parse_spec

    specs = [parse_spec(good), parse_spec(bad)]
    if any(s.kind != "release" for s in specs):
        raise EngineError("bisect over releases takes --good and --bad as vllm==X.Y.Z "
                          "(or commits, with --tree PATH)")
    g, b = (s.version for s in specs)
    assert g is not None and b is not None
    if g == b:
        raise EngineError(f"--good and --bad are both vllm=={g}")
    line = releases_between(g, b)
    if version_key(g) > version_key(b):
        line.reverse()
    return [f"vllm=={v}" for v in line]


class CommitLine:
    """The commits of a source tree from good to bad, each exported on demand."""

    def __init__(self, tree: str, good: str, bad: str) -> None:
        from replayer.replay.engines.sources.trees import commits_between, package_dir, resolve_commit

        self.tree = Path(tree).expanduser().absolute()
        if not self.tree.is_dir():
            raise EngineError(f"--tree {tree}: no such directory")
        package_dir(self.tree, tree)                  # a vLLM tree at all?
        g, b = resolve_commit(self.tree, good), resolve_commit(self.tree, bad)
        if g == b:
            raise EngineError(f"--good and --bad are both commit {g[:12]}")
        self.commits = commits_between(self.tree, g, b)

    def engine(self, commit: str):
        """The engine of one commit: its cached export, named by the commit."""
        from replayer.replay.engines.sources.specs import commit_engine

        return commit_engine(self.tree, commit)

    def close(self) -> None:
        """Nothing to remove: the exports stay cached for the next bisect."""


def header_line(engines: int, what: str) -> str:
    return f"bisect over {engines} {what}:"


def probe_line(p: Probe) -> str:
    verdict = "the reference" if p.role == "good" else (
        "matches good" if p.matched_good else "differs from good")
    keys = "" if p.store_keys is None else f"  keys {p.store_keys}"
    return f"  {p.role:<4}  {p.engine.label}  cached {p.cached_tokens}{keys}  {verdict}"


def conclusion(res: BisectResult) -> str:
    """What follows the path: the first engine that differs and the change there."""
    from replayer.compare.outcomes import diff_table

    if res.first_bad is None:
        return "bad gives the same outcome as good: nothing to bisect"
    assert res.change is not None
    return "\n".join([
        f"first engine that differs from good: {res.first_bad.engine.label} "
        f"({len(res.path)} replays)",
        "what changed there (A: the last engine that matches good):",
        diff_table(res.change)])
