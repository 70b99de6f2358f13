"""connector: offloading: vLLM 0.32-0.34's OffloadingConnector, replayed (docs/offloading.md).

The fixtures under fixtures/offloading/ hold the hits and the CPU tier's keys
(the plugin phase checks their goldens). These tests check what the goldens
cannot say: which keys the CPU tier evicted and when, the order a load and
its request's prefill follow, the seam's own contract, and the refusals (bad
input one line naming the file; another release or store backend said
before any replay).
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from conftest import FIXTURES, cli, cli_here
from replayer.replay.engines import UnsupportedByEngine, check_supported
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError

OFFLOADING = FIXTURES / "offloading"
RETURNS = OFFLOADING / "gpu_evicted_prefix_returns_from_cpu.yaml"
FULL = OFFLOADING / "cpu_tier_full_evicts_the_prefix.yaml"
BLOCK = 16


@pytest.mark.parametrize("config, needle", [
    ({}, "engine.connector offloading needs engine.connector_config.cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "fifo"},
     "engine.connector_config.eviction_policy must be one of lru, arc, got 'fifo'"),
    ({"cpu_bytes_to_use": 1 << 20, "num_cpu_blocks": 8},
     "unknown key 'num_cpu_blocks' in engine.connector_config"),
    ({"cpu_bytes_to_use": "lots"}, "engine.connector_config.cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1 << 20, "offload_prompt_only": "yes"},
     "engine.connector_config.offload_prompt_only must be a bool"),
])
def test_a_bad_offloading_config_is_one_line_naming_the_file(config, needle):
    with pytest.raises(TraceError) as err:
        EngineBlock.from_dict("s.yaml", {"connector": "offloading", "connector_config": config})
    text = str(err.value)
    assert text.startswith("s.yaml: ") and needle in text and "\n" not in text


def test_the_mooncake_segment_size_is_refused_beside_offloading():
    with pytest.raises(TraceError, match="mooncake_global_segment_size needs engine.connector "
                                         "mooncake_store"):
        EngineBlock.from_dict("s.yaml", {"connector": "offloading",
                                         "connector_config": {"cpu_bytes_to_use": 4096},
                                         "mooncake_global_segment_size": "64MB"})


@pytest.mark.parametrize("version", ["0.29.0", "0.31.0"])
def test_other_releases_are_refused_in_one_line_before_vllm_is_imported(version):
    engine = EngineBlock.from_dict("s.yaml", {"connector": "offloading",
                                              "connector_config": {"cpu_bytes_to_use": 4096}})
    with pytest.raises(UnsupportedByEngine, match=rf"connector replay \(offloading\) is not "
                                                  rf"supported on vLLM {version} yet "
                                                  rf".*0\.32\.x, 0\.33\.x"):
        check_supported(version, engine, f"vllm=={version}")
    for served in ("0.32.0", "0.33.0"):             # the releases it runs on
        check_supported(served, engine, f"vllm=={served}")


def test_the_transfer_seam_reports_each_job_finished_once():
    from replayer.replay.engines.connector.offloading_0_33 import FinishedTransfers

    seam = FinishedTransfers()
    assert seam.submit_store(3, None, None) and seam.submit_load(4, None, None, expedited=True)
    done = seam.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(3, True), (4, True)]
    assert seam.get_finished() == []                       # reported once


def test_the_model_workers_transfer_handler_copies_each_groups_pages():
    # HostCopies (worker/offload.py): a store copies each group's blocks into CPU
    # chunks of blocks_per_chunk blocks, entering the first chunk at the group's
    # block index, as vLLM's CPUOffloadingWorker does; a load copies them back.
    from types import SimpleNamespace as NS

    import numpy as np
    import torch

    from replayer.replay.engines.worker.offload import HostCopies

    kv = [torch.arange(8 * 6, dtype=torch.int8).view(8, 6), torch.zeros(8, 4, dtype=torch.int8)]
    caches = NS(tensors=[NS(tensor=t, page_size_bytes=t.shape[1]) for t in kv],
                group_data_refs=[[NS(tensor_idx=0, page_size_bytes=6)],
                                 [NS(tensor_idx=1, page_size_bytes=4)]])
    kv[1][5] = 7
    seam = HostCopies(caches, blocks_per_chunk=2, num_chunks=4)
    # group 0: GPU blocks 3, 1 from block index 1 (the second half of chunk 2,
    # then chunk 0's first half); group 1: GPU block 5 at index 0 (chunk 3).
    gpu = NS(block_ids=np.array([3, 1, 5]), group_sizes=[2, 1], block_indices=[1, 0])
    cpu = NS(block_ids=np.array([2, 0, 3]))
    assert seam.submit_store(1, gpu, cpu)
    assert torch.equal(seam.chunks[0][5], kv[0][3]) and torch.equal(seam.chunks[0][0], kv[0][1])
    assert torch.equal(seam.chunks[1][6], kv[1][5]) and not seam.chunks[0][4].any()
    back = NS(block_ids=np.array([6, 7, 0]), group_sizes=[2, 1], block_indices=[1, 0])
    assert seam.submit_load(2, cpu, back)
    assert torch.equal(kv[0][6], kv[0][3]) and torch.equal(kv[0][7], kv[0][1])
    assert torch.equal(kv[1][0], torch.full((4,), 7, dtype=torch.int8))
    assert [r.job_id for r in seam.get_finished()] == [1, 2]


def test_a_prefix_the_gpu_evicted_is_loaded_back_from_the_cpu_tier(tmp_path):
    ops_file, out_file = tmp_path / "ops.parquet", tmp_path / "out.json"
    proc = cli("run", RETURNS, "--store-ops", ops_file, "--json", out_file)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(out_file.read_text())
    again = {r["id"]: r for r in out["requests"]}["a_again"]
    assert (again["num_local_cached_tokens"], again["num_external_cached_tokens"]) == (240, 784)
    assert out["store"]["backend"] == "cpu"
    ops = pl.read_parquet(ops_file)
    assert ops["key"].str.starts_with("cpu@group:0@").all()
    gets = ops.filter(pl.col("op") == "get")
    # One get per block past the local hit, each filed under the loader.
    assert gets["boundary"].to_list() == list(range(256, 1025, BLOCK))
    assert set(gets["loader"]) == {"a_again"} and set(gets["request"]) == {"a"}
    # An asynchronous load: its gets are made in the step before the prefill.
    assert set(gets["step"]) == {again["prefill_step"] - 1}
    # vLLM defers each store job a step: a's blocks land once a has finished.
    a_puts = ops.filter((pl.col("op") == "put") & (pl.col("request") == "a"))
    assert a_puts.height == 1024 // BLOCK and set(a_puts["step"]) == {1}
    assert ops.filter(pl.col("op") == "evict").height == 0         # 4 MiB holds both


def test_a_full_cpu_tier_evicts_the_deepest_blocks_first(tmp_path):
    ops_file = tmp_path / "ops.parquet"
    proc = cli("run", FULL, "--store-ops", ops_file)
    assert proc.returncode == 0, proc.stderr
    ops = pl.read_parquet(ops_file)
    evicted = ops.filter(pl.col("op") == "evict")
    first = evicted.filter(pl.col("step") == evicted["step"].min())
    # b's 64 blocks need 48 of a's 80 chunks: vLLM's LRU gives up a's deepest.
    assert set(first["request"]) == {"a"}
    assert sorted(first["boundary"]) == list(range(272, 1025, BLOCK))
    gets = ops.filter(pl.col("op") == "get")
    assert gets["boundary"].to_list() == [256]        # the one block past the local hit left


def test_offloading_refuses_a_mooncake_store_in_one_line():
    proc = cli_here("run", RETURNS, "--store", "mooncake")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "offloading keeps its blocks in vLLM's own CPU tier" in lines[0]


def test_store_events_are_refused_for_offloading(tmp_path):
    text = RETURNS.read_text().replace(
        "requests:", "events:\n  - {after: a, action: store_remove, keys: [{request: a}]}\n"
                     "requests:", 1)
    src = tmp_path / "s.yaml"
    src.write_text(text)
    proc = cli_here("run", src)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "store_remove names MooncakeStore keys" in lines[0]
    assert lines[0].startswith(f"replayer: error: {src}: ")
