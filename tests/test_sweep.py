"""``replayer sweep``: the same table serially, on a process pool and on Ray."""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, cli
from helpers_traces import assert_bad_input
from replayer.analysis.sweep import comparable, parse_grid, run_sweep

SCENARIO = """\
engine: {block_size: 16, num_gpu_blocks: 24, max_num_seqs: 2, max_num_batched_tokens: 512}
requests:
  - {id: a, prompt: [{stream: doc, len: 300}]}
  - {id: b, after: a, prompt: [{stream: other, len: 300}]}
  - {id: c, after: b, prompt: [{stream: doc, len: 300}]}
  - {id: d, after: c, prompt: [{stream: other, len: 290}, {stream: tail, len: 20}]}
"""


def test_parse_grid_is_a_product():
    keys, points = parse_grid(["num_gpu_blocks=24,64", "engine.speculative={method: eagle, "
                                                       "num_speculative_tokens: 1},null"])
    assert keys == ["engine.num_gpu_blocks", "engine.speculative"]
    assert len(points) == 4
    assert points[1] == ["engine.num_gpu_blocks=24", "engine.speculative=null"]


@pytest.mark.slow
def test_four_points_identical_serial_pool_and_ray(tmp_path):
    import ray                  # the ray extra: make test installs it; missing is a failure
    target = tmp_path / "tiny_cache.yaml"
    target.write_text(SCENARIO)
    keys, points = parse_grid(["num_gpu_blocks=24,40", "block_size=16,32"])
    serial = run_sweep(str(target), points, executor="serial")
    pool = run_sweep(str(target), points, executor="pool", workers=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONHASHSEED": "0",
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}})
    try:
        on_ray = run_sweep(str(target), points, executor="ray")
    finally:
        ray.shutdown()
    assert comparable(serial) == comparable(pool) == comparable(on_ray)
    assert all(r["wall_s"] > 0 for r in serial + pool + on_ray)
    # The table says something: a bigger cache gets back what the small one evicted.
    by_point = {(r["engine.num_gpu_blocks"], r["engine.block_size"]): r for r in serial}
    assert by_point[("24", "16")]["lost_capacity"] > 0
    assert by_point[("40", "16")]["actual"] > by_point[("24", "16")]["actual"]
    for r in serial:
        assert r["reachable"] - r["actual"] == sum(r[k] for k in r if k.startswith("lost_"))
        assert r["lost_unexplained"] == 0


@pytest.mark.slow
def test_cli_sweep_prints_and_writes(tmp_path):
    target = tmp_path / "tiny_cache.yaml"
    target.write_text(SCENARIO)
    proc = cli("sweep", target, "--grid", "num_gpu_blocks=24,40", "--jobs", "1",
               "--json", tmp_path / "s.json", "--parquet", tmp_path / "s.parquet", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "2 point(s)" in proc.stdout and "hit_rate" in proc.stdout
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["grid"] == ["engine.num_gpu_blocks"]
    assert [r["engine.num_gpu_blocks"] for r in doc["rows"]] == ["24", "40"]
    assert all("wall_s" not in r for r in doc["rows"])


@pytest.mark.parametrize("grid, needle", [
    ("num_gpu_blocks", "expected KEY=V1,V2"),
    ("num_gpu_blocks=1,,2", "no empty value"),
    ("blok=1,2", "unknown engine key 'blok'"),
])
def test_bad_grid_is_one_line(grid, needle):
    proc = cli("sweep", REPO / "fixtures" / "scenarios" / "reset_prefix_cache.yaml",
               "--grid", grid)
    assert_bad_input(proc, needle)
