"""Kimi-K3's shape (fixtures/kimi_k3, docs/kimi-k3.md).

The fixtures' block size and groups are not copied from a log: the first test
derives them with vLLM's own functions on the bundled Kimi-K3 config
(replayer/replay/engines/shapes/kimi_k3.py) and fails when a fixture says
otherwise. The others check what the adapters put on the KDA layers' MambaSpec
(the FlashKDA checkpoint fields each release's KimiK3DeltaAttention sets) and
that the engine keys refuse what they should. The fixtures' hits are checked by
their goldens (pytest fixtures/, and `check --engine` per release).
"""

from __future__ import annotations

import re

import pytest

from conftest import FIXTURES
from replayer.replay.engines.sources.releases import release_sources
from traces import load_target
from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError

KIMI = FIXTURES / "kimi_k3"
KDA_LAYER = "models/kimi_k3/nvidia/kda.py"


def kimi_fixtures():
    paths = sorted(KIMI.glob("*.yaml"))
    assert paths, f"no fixture under {KIMI}"
    return paths


def test_every_kimi_fixture_has_the_geometry_vllm_derives():
    """Block size, group kinds and order as vLLM derives them for the fixture's
    TP, DCP and draft length: 7 draft tokens keep the 1536-token block of the
    upstream reports; 8 would make it 1664."""
    from replayer.replay.engines.shapes.kimi_k3 import derive

    derived = {}
    for path in kimi_fixtures():
        engine = load_target(path).engine
        key = (engine.tensor_parallel_size, engine.decode_context_parallel_size,
               engine.num_speculative_tokens)
        if key not in derived:
            derived[key] = derive(key[0], key[2], decode_context_parallel_size=key[1])
        g = derived[key]
        assert engine.model == "kimi-k3" and engine.kda_prefill_backend == "flashkda", path
        assert engine.block_size == g.block_size, path
        assert [grp.kind for grp in engine.kv_groups] == [k for k, _, _ in g.groups], path
        assert {grp.block_size for grp in engine.kv_groups} == {g.block_size}, path
    g = derived[(8, 8, 7)]
    assert (g.block_size, g.page_bytes, g.kda_page_bytes) == (1536, 884736, 878592)
    assert [span for _, _, span in g.groups] == [1536, 1536, 1536, 12288]
    assert g.prefill_checkpoint_alignment == 16
    eight = derive(8, 8, decode_context_parallel_size=8)
    assert (eight.block_size, eight.kda_page_bytes) == (1664, 887808)


def test_the_kda_spec_carries_flashkda_checkpoints_on_0_33():
    """What KimiK3DeltaAttention.get_kv_cache_spec adds, as the 0.33 adapter builds it."""
    from replayer.replay.engines.vllm_0_33 import layer_specs

    engine = load_target(KIMI / "vllm51295.yaml").engine
    specs = layer_specs(engine)
    kda = [s for s in specs.values() if type(s).__name__ == "MambaSpec"]
    assert kda and all((s.num_prefill_checkpoint_blocks, s.prefill_checkpoint_alignment)
                       == (1, 16) for s in kda)
    plain = layer_specs(engine.with_settings(kda_prefill_backend="triton"))
    assert all(s.num_prefill_checkpoint_blocks == 0 and s.prefill_checkpoint_alignment is None
               for s in plain.values() if type(s).__name__ == "MambaSpec")


@pytest.mark.parametrize("version, marks", [
    ("0.29.0", 'num_prefill_checkpoint_blocks=int(self.kda_prefill_backend == "flashkda")'),
    ("0.30.0", '16 if self.kda_prefill_backend == "flashkda" else None'),
    ("0.31.0", "kda_prefill_checkpoint_alignment(self.kda_prefill_backend)"),
    ("0.32.0", "kda_prefill_checkpoint_alignment(self.kda_prefill_backend)"),
])
def test_each_release_marks_flashkda_checkpoints_as_its_adapter_does(version, marks):
    """vllm_0_29.kda_checkpoint_fields writes 0.29's and 0.30's inline values and
    calls 0.31's and 0.32's function: the release's own KDA layer says the same."""
    from replayer.replay.engines.vllm_0_29 import FLASHKDA_CHECKPOINT_ALIGNMENT_0_30

    text = (release_sources(version) / KDA_LAYER).read_text()
    assert marks in text
    if version == "0.29.0":
        assert "prefill_checkpoint_alignment" not in text
    if version == "0.30.0":
        assert FLASHKDA_CHECKPOINT_ALIGNMENT_0_30 == 16


@pytest.mark.parametrize("engine, message", [
    ({"kda_prefill_backend": "flashkda"},
     "engine.kda_prefill_backend needs a mamba group"),
    ({"kv_groups": [{"kind": "mla"}, {"kind": "mamba"}], "kda_prefill_backend": "auto"},
     "engine.kda_prefill_backend must be one of flashkda, flashinfer, triton, got 'auto'"),
    ({"model": "kimi-k2"}, "engine.model 'kimi-k2' is not a bundled model (known: "
                           "tiny-llama, kimi-k3)"),
])
def test_bad_kimi_keys_are_refused(engine, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        EngineBlock.from_dict("scenario.yaml", engine)
