"""PLANTED FAULT (tests only; run in the engine process by PREFIX_REPLAYER_PLANT).

vLLM #56615's fault (b): MooncakeStore publishes the attention companion of a
hybrid's prompt-tail Mamba checkpoint (the KV block through B + H, H the EAGLE
proof margin) before the model runner computed through B + H. vLLM's fix is the
``completed_token_len`` guard in the store scheduler's
``_partial_tail_non_mamba_puts`` (a group whose ``proof_end`` lies past the
tokens computed so far is left out, and published by a later save that covers
it). This plant removes exactly that guard: the function runs with the
request's computed length taken as unbounded, so a companion is put with the
KV of the positions not yet computed (whatever the block held). Every key,
lookup and hit count is unchanged where the store already held the key;
where the companion's key is a full block's, the store keeps this first,
half-computed value and a later resend loads it. `check --recompute` must
name the request that read it back.
"""

import sys

import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler as store_scheduler

if not getattr(store_scheduler, "_planted_companion_before_computed", False):
    _real = store_scheduler._partial_tail_non_mamba_puts

    def _partial_tail_non_mamba_puts(coord, req_meta, block_sizes):
        completed = req_meta.completed_token_len
        req_meta.completed_token_len = sys.maxsize      # the guard, gone
        try:
            return _real(coord, req_meta, block_sizes)
        finally:
            req_meta.completed_token_len = completed

    store_scheduler._partial_tail_non_mamba_puts = _partial_tail_non_mamba_puts
    store_scheduler._planted_companion_before_computed = True
