"""``replayer sweep``: one explained replay per grid point, one table.

Every point is independent and deterministic (the same trace and engine give
the same outcome in any process), so what runs them does not change the
table: serially, a local process pool (:mod:`concurrent.futures`, spawned
interpreters under the pinned hash seed; threads when the warm server runs,
since every replay is then a fork of the server's engine), or Ray past one machine
(``--ray ADDRESS``; the ``ray`` extra). Workers load the target themselves,
so a point is a path and a few ``--set`` strings, never a pickled trace.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Sequence

from replayer import SOURCE_ROOT
from replayer.analysis.explain import CAUSES
from traces import TraceError

WALL = "wall_s"


def _split_values(text: str) -> list[str]:
    """``1,2,{a: 1, b: 2}`` -> three values: commas inside brackets stay."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def parse_grid(grids: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """``KEY=V1,V2`` options -> (keys, the points as --set strings, key order kept)."""
    from traces.scenarios.what_if import parse_set

    keys: list[str] = []
    axes: list[list[str]] = []
    for g in grids:
        key, sep, values = g.partition("=")
        key = key.strip()
        if not key.startswith("engine."):
            key = f"engine.{key}"
        vals = _split_values(values) if sep else []
        if not sep or not all(vals):
            raise TraceError(f"--grid {g}", "expected KEY=V1,V2,... with no empty value")
        if key in keys:
            raise TraceError(f"--grid {g}", f"{key} is given twice")
        for v in vals:
            parse_set(f"{key}={v}")                 # a bad value is reported before any run
        keys.append(key)
        axes.append([f"{key}={v}" for v in vals])
    return keys, [list(p) for p in itertools.product(*axes)]


def run_point(target: str, sets: list[str], engine_spec: str = "installed",
              base: Sequence[str] = (), own_process: bool = False,
              segmented: Any = None) -> dict[str, Any]:
    """Load ``target``, replay it under ``base`` then ``sets`` (the grid point) with its
    counterfactuals: one table row. ``segmented``: a :class:`Segmented` that
    replays each of them in time segments."""
    from replayer.replay.execution.environment import quiet_vllm
    from traces import load_target
    from traces.scenarios.what_if import with_sets

    quiet_vllm(os.environ.get("PREFIX_REPLAYER_VERBOSE") == "1")   # a worker, as the CLI
    from replayer.analysis.explain import explain
    from replayer.replay.execution.clients import engine_runner

    start = time.perf_counter()
    trace = with_sets(load_target(target), [*base, *sets])
    with engine_runner(engine_spec, own_process=own_process) as run:
        if segmented is not None:
            ex = explain(trace, run=lambda t: segmented(t, fallback=run))
        else:
            many = run.replay_many if getattr(run, "parallel", False) else None
            ex = explain(trace, run=lambda t: run(t), run_many=many)
    s = ex.summary()
    row: dict[str, Any] = {k.partition("=")[0]: k.partition("=")[2] for k in sets}
    row.update(requests=s["requests"], prompt_tokens=s["prompt_tokens"],
               reachable=s["reachable"], actual=s["actual"], hit_rate=s["hit_rate"],
               reachable_rate=s["reachable_rate"],
               **{f"lost_{c}": s["lost"][c] for c in CAUSES}, steps=s["steps"])
    row[WALL] = round(time.perf_counter() - start, 3)
    return row


def _pinned_env() -> dict[str, str]:
    from replayer.replay.execution.determinism import INTERPRETER_SEED

    return {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", INTERPRETER_SEED)}


class Segmented:
    """Each replay of every point in ``segments`` time segments, on one host kept
    for the whole sweep (``pool``: local processes; ``ray``: actors on the
    cluster); a trace that cannot split replays on the point's own runner.
    ``reports`` keeps what happened at the boundaries (a segment report per
    replay, or why it replayed in one piece)."""

    def __init__(self, segments: int, warm_up: str, engine_spec: str, executor: str,
                 workers: int | None, ray_address: str | None) -> None:
        from replayer.replay.engines.sources.specs import resolve
        from replayer.replay.segments.hosts import make_host

        self.segments, self.warm_up, self.engine_spec = segments, warm_up, engine_spec
        # A release's segments run on processes that import it (not on Ray).
        self.host = make_host((ray_address or "local") if executor == "ray" else None,
                              1 if executor == "serial" else workers, segments,
                              os.environ.get("PREFIX_REPLAYER_VERBOSE") == "1",
                              engine=resolve(engine_spec))
        self.reports: list[Any] = []

    def __call__(self, trace: Any, fallback: Any) -> Any:
        from replayer.replay.segments import replay_segments, warm_up_steps
        from replayer.replay.segments.worker import serial_reason

        why = serial_reason(trace, self.engine_spec)
        if why is not None:
            self.reports.append(why)
            return fallback(trace)
        result, report = replay_segments(trace, self.host, self.segments,
                                         warm_up_steps(self.warm_up, trace), self.warm_up,
                                         spec=self.engine_spec)
        self.reports.append(report)
        return result

    def close(self) -> None:
        self.host.close()


def run_sweep(target: str, points: list[list[str]], *, engine_spec: str = "installed",
              executor: str = "serial", workers: int | None = None,
              ray_address: str | None = None, base: Sequence[str] = (),
              segments: int = 1, warm_up: str = "2m",
              reports: list[Any] | None = None) -> list[dict[str, Any]]:
    """Rows in grid order, whatever ran them: ``serial``, ``pool`` or ``ray``.

    ``segments`` > 1: the points run one after another and each replay is split
    into that many time segments on the executor (what happened at each
    boundary is added to ``reports``)."""
    target = str(target)
    base = list(base)
    if segments > 1:
        seg = Segmented(segments, warm_up, engine_spec, executor, workers, ray_address)
        try:
            return [run_point(target, p, engine_spec, base, segmented=seg) for p in points]
        finally:
            seg.close()
            if reports is not None:
                reports.extend(seg.reports)
    if executor == "serial":
        return [run_point(target, p, engine_spec, base) for p in points]
    from replayer.replay.execution.clients import warm_server_running

    if executor == "pool" and warm_server_running():
        # Every replay is a fork on the server: threads here only wait on sockets.
        # (own_process: a cold fallback never builds two engines in this process.)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, len(points))) as threads:
            return list(threads.map(lambda p: run_point(target, p, engine_spec, base, True),
                                    points))
    if executor == "pool":
        n = max(1, min(len(points), workers or os.cpu_count() or 1))
        # Spawned, not forked: a fresh interpreter per worker under this one's
        # hash seed (the CLI pinned it), and no copied vLLM/torch state.
        os.environ.update(_pinned_env())
        with ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn")) as pool:
            return list(pool.map(run_point, [target] * len(points), points,
                                 [engine_spec] * len(points), [base] * len(points)))
    if executor == "ray":
        return _run_ray(target, points, engine_spec, ray_address, base)
    raise ValueError(f"unknown executor {executor!r}")


def _run_ray(target: str, points: list[list[str]], engine_spec: str,
             address: str | None, base: list[str]) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise TraceError("--ray", "Ray is not installed (pip install 'prefix-replayer[ray]')") \
            from None
    started = False
    if not ray.is_initialized():
        # Workers start with the pinned hash seed and this checkout importable.
        env = {**_pinned_env(), "PYTHONPATH": os.pathsep.join(
            filter(None, [str(SOURCE_ROOT),
                          os.environ.get("PYTHONPATH")]))}
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                 include_dashboard=False, logging_level="ERROR")
        started = True
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        return ray.get([remote.remote(target, p, engine_spec, base) for p in points])
    finally:
        if started:
            ray.shutdown()


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without wall times, for equality across executors."""
    return [{k: v for k, v in r.items() if k != WALL} for r in rows]


def table_text(keys: list[str], rows: list[dict[str, Any]]) -> str:
    """The sweep table: one line per point; lost-token columns for causes seen."""
    import polars as pl

    causes = [c for c in CAUSES if any(r[f"lost_{c}"] for r in rows) or c == "unexplained"]
    frame = pl.DataFrame([{**{k.removeprefix("engine."): r[k] for k in keys},
                           "hit_rate": f"{r['hit_rate']:.1%}",
                           "reachable": f"{r['reachable_rate']:.1%}",
                           **{c: r[f"lost_{c}"] for c in causes},
                           "steps": r["steps"], "wall_s": r[WALL]} for r in rows])
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
                   tbl_formatting="ASCII_FULL_CONDENSED", tbl_width_chars=200, tbl_cols=-1):
        return str(frame)
