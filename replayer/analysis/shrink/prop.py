"""The one property a shrink keeps, and the probes that test it.

A probe is a real replay (``--diff``: one per engine; ``--lost-by``:
explain's baseline and counterfactuals) of a candidate :class:`~.case.Case`.
:class:`Prober` counts probes, caches them by the case's digest (a search
that asks twice pays once), enforces ``--max-probes`` and ``--timeout``, and
runs a batch side by side where the client can (the warm server's forks),
picking the lowest passing index so the outcome never depends on timing.
A replay that fails (an engine vLLM refuses to build, a replay that cannot
finish) is "property lost" for a candidate, and an error for the input.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from replayer.analysis.shrink.case import Case


class LimitReached(Exception):
    """``--max-probes`` or ``--timeout`` ran out: the best case so far stands."""


@dataclass
class Verdict:
    holds: bool
    detail: str                                 # what this replay gave, in one phrase
    focus: str | None = None                    # the request the property is about
    value: int = 0                              # --lost-by: the tokens lost to the cause
    results: dict[str, Any] = field(default_factory=dict)   # engine text -> ReplayResult


class LostBy:
    """``--request ID --lost-by CAUSE [--at-least N]``: explain's accounting."""

    def __init__(self, request: str, cause: str, at_least: int | None, engine: str) -> None:
        self.request, self.cause, self.at_least, self.engine = request, cause, at_least, engine
        self.engines = [engine]

    def describe(self, request: str | None = None) -> str:
        n = "as many tokens as the input" if self.at_least is None else f"{self.at_least} tokens"
        return (f"request {request or self.request} loses at least {n} to {self.cause} "
                f"(replayer explain) on {self.engine}")

    def evaluate(self, case: Case, clients: dict[str, Any], request: str | None = None) -> Verdict:
        from replayer.analysis.explain import explain

        rid = request or self.request
        client = clients[self.engine]
        many = client.replay_many if getattr(client, "parallel", False) else None
        ex = explain(case.to_trace(), run=client, run_many=many)
        row = ex.table.filter(ex.table["id"] == rid).row(0, named=True)
        lost = int(row[f"lost_{self.cause}"])
        need = self.at_least if self.at_least is not None else 1
        causes = ", ".join(f"{c} {row[f'lost_{c}']}" for c in _causes() if row[f"lost_{c}"])
        detail = (f"request {rid} loses {lost} token(s) to {self.cause} (reachable "
                  f"{row['reachable']}, actual {row['actual']}; lost by cause: "
                  f"{causes or 'none'})")
        return Verdict(lost >= need and lost > 0, detail, rid, value=lost,
                       results={self.engine: ex.baseline})


def _causes() -> tuple[str, ...]:
    from replayer.analysis.explain import CAUSES

    return CAUSES


class Differ:
    """``--diff A B [--on outcomes|store] [--request ID]``: the engines disagree."""

    def __init__(self, a: str, b: str, on: str, request: str | None) -> None:
        self.a, self.b, self.on, self.request = a, b, on, request
        self.engines = [a, b]

    def describe(self, request: str | None = None) -> str:
        rid = request or self.request
        what = "hits (cached tokens)" if self.on == "outcomes" else "store keys or lookups"
        on = f"request {rid}'s {what}" if rid else f"some request's {what}"
        return f"{self.a} and {self.b} disagree on {on}"

    def evaluate(self, case: Case, clients: dict[str, Any], request: str | None = None) -> Verdict:
        from replayer.compare.outcomes import compare_results

        rid = request or self.request
        trace = case.to_trace()
        ra, rb = clients[self.a](trace), clients[self.b](trace)
        d = compare_results(ra, rb)
        results = {self.a: ra, self.b: rb}
        if self.on == "store":
            s = d.store
            named = [] if s is None else (
                [k.request for k in s.only_a + s.only_b] + [x.request for x in s.lookup_diffs])
            hits = named if rid is None else [r for r in named if r == rid]
            detail = ("no store on either side" if s is None else
                      f"store: {len(s.only_a)} key(s) only on A, {len(s.only_b)} only on B, "
                      f"{len(s.lookup_diffs)} lookup(s) differ"
                      + (f" ({len(hits)} of them name {rid})" if rid else ""))
            return Verdict(bool(hits), detail, hits[0] if hits else rid, results=results)
        differing = [x for x in d.differing if rid is None or x.id == rid]
        if rid is not None:
            ca = ra.by_id()[rid].num_cached_tokens
            cb = rb.by_id()[rid].num_cached_tokens
            detail = f"request {rid}: {self.a} cached {ca}, {self.b} cached {cb}"
        else:
            detail = (f"{len(d.differing)} of {d.requests} request(s) differ"
                      + (f" (first: {d.differing[0].id})" if d.differing else ""))
        return Verdict(bool(differing), detail, differing[0].id if differing else rid,
                       results=results)


#: Candidates evaluated per batch, whatever the concurrency: the probes a search
#: spends (said in the scenario's description) never depend on the machine.
BATCH = 4


class Prober:
    """Probes with a budget, a cache and side-by-side batches."""

    def __init__(self, prop: Any, clients: dict[str, Any], *, max_probes: int | None = None,
                 timeout: float | None = None, workers: int = 1,
                 on_probe: Callable[[], None] | None = None) -> None:
        self.prop, self.clients = prop, clients
        self.max_probes, self.timeout = max_probes, timeout
        self.workers = max(1, workers)          # at once; batches are BATCH long
        self.batch = BATCH
        self.started = time.monotonic()
        self.probes = 0
        self.on_probe = on_probe or (lambda: None)
        self._cache: dict[str, bool] = {}
        # case key -> the fewest num_gpu_blocks its engines build with (vLLM's own floor)
        self._floors: dict[str, int] = {}
        self._lock = threading.Lock()
        self.errors = 0                         # probes whose replay failed (counted as lost)
        self.first_error: str | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _take(self) -> None:
        with self._lock:
            if self.max_probes is not None and self.probes >= self.max_probes:
                raise LimitReached(f"--max-probes {self.max_probes} reached")
            if self.timeout is not None and self.elapsed() > self.timeout:
                raise LimitReached(f"--timeout {self.timeout:g} s reached")
            self.probes += 1

    def verdict(self, case: Case, request: str | None = None) -> Verdict:
        """One evaluation whose errors propagate (the input, the written scenario)."""
        return self.prop.evaluate(case, self.clients, request)

    def holds(self, case: Case) -> bool:
        key = case.key()
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        self._take()
        try:
            verdict = self.prop.evaluate(case, self.clients)
            ok = verdict.holds
            self.note_floor(case, verdict)
        except (LimitReached, KeyboardInterrupt):
            raise
        except Exception as exc:    # vLLM refused the engine, the replay could not finish
            ok = False
            with self._lock:
                self.errors += 1
                if self.first_error is None:    # its first line, whole
                    self.first_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        with self._lock:
            self._cache[key] = ok
        self.on_probe()
        return ok

    def note_floor(self, case: Case, verdict: Verdict) -> None:
        """Keep what ``verdict``'s replays say of vLLM's smallest pool for ``case``."""
        floors = [r.min_gpu_blocks for r in verdict.results.values()
                  if getattr(r, "min_gpu_blocks", None) is not None]
        if floors:
            with self._lock:
                self._floors[case.key()] = max(floors)

    def gpu_blocks_floor(self, case: Case) -> int | None:
        """The fewest ``num_gpu_blocks`` every engine builds ``case`` with, as vLLM
        itself counts them (None: no engine tells). Known from the probe that kept
        ``case``; else one more probe (counted)."""
        with self._lock:
            if case.key() in self._floors:
                return self._floors[case.key()]
        self._take()
        self.note_floor(case, self.prop.evaluate(case, self.clients))
        self.on_probe()
        with self._lock:
            return self._floors.get(case.key())

    def first_passing(self, cases: Sequence[Case]) -> int | None:
        """The lowest index whose case keeps the property (None: none does).

        Evaluated :data:`BATCH` at a time (``workers`` of them at once); a
        batch holding a pass ends the search, and within it the lowest index
        wins, so the answer is the one a one-at-a-time search would give."""
        for start in range(0, len(cases), self.batch):
            batch = list(cases[start:start + self.batch])
            oks = self._many(batch)
            for j, ok in enumerate(oks):
                if ok:
                    return start + j
        return None

    def all_of(self, cases: Sequence[Case]) -> list[bool]:
        """Every case's verdict (``workers`` at once)."""
        out: list[bool] = []
        for start in range(0, len(cases), self.batch):
            out += self._many(list(cases[start:start + self.batch]))
        return out

    def _many(self, batch: list[Case]) -> list[bool]:
        if len(batch) == 1 or self.workers == 1:
            return [self.holds(c) for c in batch]
        pool = ThreadPoolExecutor(max_workers=min(self.workers, len(batch)))
        try:
            futures = [pool.submit(self.holds, c) for c in batch]
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
