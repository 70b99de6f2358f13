"""PLANTED FAULT (tests only; run in the engine process by PREFIX_REPLAYER_PLANT).

A Mamba (linear-attention) state registered at a boundary B but materialised
earlier: when a request resumes from a prefix hit, the model runner takes the
state kept in the block one block before the one vLLM chose (the state of an
earlier boundary, up to one block short of B), as a runner that checkpointed
the state before the last block of the prefix would. The scheduler's hit is
untouched, so every hit count and golden is unchanged; only the state the hit
resumes from is wrong. `check --recompute` must name the request.
"""

import vllm.v1.worker.mamba_utils as mu

if not getattr(mu, "_planted_mamba_state_one_block_early", False):
    _real = mu.preprocess_mamba

    def preprocess_mamba(scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
                         input_batch, requests, *args, **kwargs):
        block_size = cache_config.mamba_block_size
        for new in scheduler_output.scheduled_new_reqs:
            resume = (new.num_computed_tokens - 1) // block_size
            if new.num_computed_tokens > 0 and resume >= 1 and new.req_id not in mamba_state_idx:
                mamba_state_idx[new.req_id] = resume - 1
        return _real(scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
                     input_batch, requests, *args, **kwargs)

    mu.preprocess_mamba = preprocess_mamba
    mu._planted_mamba_state_one_block_early = True
