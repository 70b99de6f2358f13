"""vLLM 0.34.0 as a release engine (docs/engines.md, "vLLM 0.34").

The 0.33 adapter and the store adapter serve it; what 0.34 changed in the
replay's path that the fixtures show is one thing: lookahead block hashes now
apply under the MooncakeStore connector (``supports_lookahead_block_hashes``),
so with EAGLE the resend after a reset is no longer dropped a prefix-match unit
below the prompt's last boundary. A one-prompt slice of the #56615 resend
(``fixtures/store/resend_after_reset.yaml``'s first pair, lookahead hashes
left on) replayed on 0.33.0 and on 0.34.0: the 0.34 release's sources, its
connector stepped as its runner does, the in-process lookup client.
"""

from __future__ import annotations

import json

import pytest

from conftest import cli
from helpers_segments import WAVES, assert_waves_split, release_split, waves_scenario

pytestmark = pytest.mark.slow       # one engine process of 0.34 (~10 s of vLLM imports)

SLICE = """\
engine:
  block_size: 1536
  prefix_match_unit: 128
  kv_groups: [{kind: full_attention}, {kind: mamba}]
  speculative: {method: eagle, num_speculative_tokens: 1}
  prefix_cache_retention_interval: 0
  max_num_batched_tokens: 8192
  max_num_seqs: 16
  num_gpu_blocks: 64
  connector: mooncake_store
requests:
  - {id: p7449, prompt: [{stream: a, len: 7449}]}
  - {id: p7449_again, after: p7449, prompt: [{stream: a, len: 7449}]}
events:
  - {after: p7449, action: reset_prefix_cache}
"""


def test_0_34_keeps_the_last_unit_a_store_resend_lost_to_the_eagle_drop_on_0_33(tmp_path):
    scenario = tmp_path / "resend.yaml"
    scenario.write_text(SLICE)
    out = tmp_path / "diff.json"
    proc = cli("diff", scenario, "--engine", "installed", "--engine", "vllm==0.34.0",
               "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["a"]["vllm"] == "0.33.0"               # the installed vLLM
    assert data["b"] == {"vllm": "0.34.0", "source": "release"}
    # 7424 = 7448 // 128 * 128: the store's last prefix-match boundary; 0.33 drops one unit.
    assert data["requests"] == [{
        "id": "p7449_again", "delta": 128,
        "a": {"num_cached_tokens": 7296, "num_local_cached_tokens": 0,
              "num_external_cached_tokens": 7296},
        "b": {"num_cached_tokens": 7424, "num_local_cached_tokens": 0,
              "num_external_cached_tokens": 7424}}]
    # The Mamba state the resend loads sits at 7424 on 0.34 (7296 on 0.33).
    moved = {(k["group"], k["boundary"]) for k in data["store"]["only_b"]}
    assert (1, 7424) in moved, data["store"]


@pytest.mark.parametrize("version, refused", [("0.33.0", False), ("0.34.0", True)])
def test_lookup_async_is_refused_where_the_lookup_client_keeps_results_by_wall_clock(
        version, refused):
    """0.34's LookupKeyClient reuses a non-blocking lookup's result for a TTL of wall
    time, which a replay has none of: refused there, before any engine is built."""
    from replayer.replay.engines.base import UnsupportedByEngine
    from replayer.replay.engines.vllm_0_33 import refuse_wall_clock_lookups
    from traces.model.engine_spec import EngineBlock

    engine = EngineBlock.from_dict("s.yaml", {
        "block_size": 16, "connector": "mooncake_store",
        "connector_config": {"lookup_async": True}})
    if not refused:
        refuse_wall_clock_lookups(engine, version)
        return
    with pytest.raises(UnsupportedByEngine, match=(
            r"^vllm 0.34.0: connector_config.lookup_async: vLLM 0.34.0's MooncakeStore "
            r"lookup client reuses")):
        refuse_wall_clock_lookups(engine, version)


def _pool(ids: dict[str, list[int]], primary: dict[str, int]) -> object:
    """A stand-in for 0.34's block pool: six blocks, a map of hash key -> block id
    (``_cache``) and, for a key several blocks hold, their ids (``_dup_ids``)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(6)]
    cache = {k.encode(): primary[k] for k in ids}
    dups = {k.encode(): dict.fromkeys(v) for k, v in ids.items() if len(v) > 1}
    cached = type("BlockHashToBlockMap", (), {})()
    cached._cache, cached._dup_ids, cached._blocks = cache, dups, blocks
    pool = type("BlockPool", (), {})()
    pool.blocks, pool.cached_block_hash_to_block = blocks, cached
    pool.cached_block_hashes_by_block, pool._reuse_watchers = {}, {}
    return pool


def test_0_34s_prefix_cache_section_names_blocks_by_label_in_the_maps_order():
    """0.34's map keys block ids: the section writes labels (a pool whose physical ids
    are permuted writes the same), the block handed out first, then every holder in
    the map's order (another order is another state)."""
    from replayer.replay.engines.digest.release_0_33 import _Digest
    from replayer.replay.engines.digest.release_0_34 import _prefix_cache

    def lines(ids, primary, met):
        d, pool = _Digest(), _pool(ids, primary)
        for i in met:                     # blocks the walk met before (the free queue)
            d.block(pool.blocks[i])
        return _prefix_cache(d, pool)[:3]

    one = lines({"a": [2], "b": [4, 5]}, {"a": 2, "b": 4}, met=[4, 5])
    assert one == ["2 keys", "61 B2 [B2]", "62 B0 [B0 B1]"]
    assert lines({"a": [3], "b": [1, 0]}, {"a": 3, "b": 1}, met=[1, 0]) == one
    assert lines({"a": [2], "b": [5, 4]}, {"a": 2, "b": 5}, met=[4, 5])[2] == "62 B1 [B1 B0]"


def test_a_token_buffer_is_walked_by_its_tokens():
    """0.34 holds a request's tokens in a TokenBuffer, an array of the vllm package
    with no fields: walked as an object it would write nothing, so two requests'
    different tokens would digest alike."""
    from array import array

    from replayer.replay.engines.digest.walk import Canon

    buffer = type("TokenBuffer", (array,), {"__slots__": (),
                                             "__module__": "vllm.v1.token_buffer"})
    canon = Canon({}, {})
    a, b = canon.enc(buffer("i", [1, 2, 3]), "x"), canon.enc(buffer("i", [1, 2, 4]), "x")
    assert a.startswith("Ai3:") and a != b
    assert canon.enc(buffer("i", [1, 2, 3]), "y") == a


def test_0_34_splits_into_segments_with_the_sequential_bytes():
    """0.34's digest (digest/release_0_34.py: its map of block ids, TokenBuffers):
    live_eagle at K 3 and a 50-step warm-up in one 0.34 process, both boundaries
    proven as on 0.31.0 (tests/test_segments.py), the bytes the sequential replay's."""
    from replayer.check.output import dumps

    res, report, seq, _ = release_split("vllm==0.34.0")
    assert res.engine.vllm == "0.34.0"
    assert dumps(res) == dumps(seq)
    assert report.matched == [1, 2]


def test_0_34_splits_a_store_trace_where_0_33_does(tmp_path):
    """The store waves (tests/test_segments_store.py) on 0.34.0 at K 3, a 110-step
    warm-up, in one 0.34 process: the boundary at step 180 matches as on 0.33
    (0.34's store worker keeps its KV caches' addresses, written by length:
    digest/release_0_34.py); at 260 the stores truly differ and the segment before
    replays on. The bytes and store rows are the sequential replay's."""
    trace = waves_scenario(tmp_path / "store_waves.yaml",
                           "  connector: mooncake_store\n  mooncake_global_segment_size: 12KB\n")
    res, report, seq, _ = release_split("vllm==0.34.0", trace, warm_up=110)
    assert res.engine.vllm == "0.34.0"
    assert_waves_split(res, report, seq, "store")
    assert res.store["rows"] == seq.store["rows"]


def test_0_34s_store_worker_is_written_by_region_lengths_not_addresses():
    """Two workers whose KV caches lie at other addresses write alike; a region
    released for sleep (or another length) writes otherwise; a worker without
    0.34's fields is not digested (the boundary is never trusted)."""
    from replayer.replay.engines.digest.release_0_33 import _Digest
    from replayer.replay.engines.digest.release_0_34 import DigestError, _worker

    def line(regions, released=(), **more):
        w = type("MooncakeStoreWorker", (), {"__module__": "vllm.x"})()
        w.__dict__.update(more)
        if regions is not None:
            w._device_regions, w._released_regions = regions, set(released)
        return _worker(_Digest(), w, "rank0.worker")

    one = line({0x7F00: 16384, 0x9000: 512}, tp_rank=0)
    assert one.startswith("regions [16384, 512] released [] MooncakeStoreWorker(tp_rank=0)")
    assert line({0x1234: 16384, 0x5678: 512}, tp_rank=0) == one
    assert line({0x7F00: 16384, 0x9000: 512}, {0x9000}, tp_rank=0) != one
    assert line({0x7F00: 16384, 0x9000: 256}, tp_rank=0) != one
    with pytest.raises(DigestError, match="not 0.34's registered regions"):
        line(None, tp_rank=0)


def test_offloading_replays_on_0_34_over_registered_cpu_tensors():
    """0.34's offloading worker resolves device pointers from the KV caches it
    registered: the replay registers small CPU tensors there (REGISTERS_KV_CACHES),
    and the hybrid Mamba resend from the CPU tier matches its 0.34.0 goldens."""
    proc = cli("check", "--engine", "vllm==0.34.0",
               "fixtures/offloading/hybrid_mamba_resend_from_cpu.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[:2] == [
        "PASS fixtures/offloading/hybrid_mamba_resend_from_cpu.yaml: 3 request(s) match the "
        "goldens for vllm==0.34.0 (engine vllm==0.34.0)",
        "  store: 7 key(s) written, 11 key(s) fetched and 3 lookup(s) match the store "
        "goldens for vllm==0.34.0"]


def test_0_34_splits_an_offloading_trace_where_0_33_does(tmp_path):
    """The offload waves (tests/test_segments_offload.py) on 0.34.0 at K 3, a
    110-step warm-up, in one 0.34 process: the boundary at step 180 matches as on
    0.33 (0.34's offloading worker keeps the KV caches it registered, written by
    shape, not address: digest/release_0_34.py); at 260 the CPU tiers truly differ,
    only the offload section fails and the segment before replays on. The bytes and
    CPU-tier rows are the sequential replay's."""
    cpu_bytes = 10 * 16 * 4096
    trace = waves_scenario(tmp_path / "offload_waves.yaml",
                           "  connector: offloading\n  connector_config:\n"
                           f"    cpu_bytes_to_use: {cpu_bytes}\n", last=("z7", 40 * WAVES - 8, 0))
    res, report, seq, _ = release_split("vllm==0.34.0", trace, warm_up=110)
    assert res.engine.vllm == "0.34.0"
    assert_waves_split(res, report, seq, "offload")
    assert {r.id: r.num_external_cached_tokens for r in res.requests}["z7"] == 256
    assert res.store["rows"] == seq.store["rows"]
