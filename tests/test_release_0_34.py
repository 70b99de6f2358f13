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
    proc = cli("diff", scenario, "--engine", "vllm==0.33.0", "--engine", "vllm==0.34.0",
               "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
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
