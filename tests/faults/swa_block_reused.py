"""PLANTED FAULT (tests only; run in the engine process by PREFIX_REPLAYER_PLANT).

A sliding-window block freed while a later hit still resumes through it: when a
request starts from a prefix hit, the last cached block of each sliding-window
group inside its window is handed to another owner and overwritten (zeros)
before the request's first step reads it. The scheduler still counts the hit:
every hit count, and so every golden, is unchanged; only the KV the hit
resumes through is wrong. `check --recompute` must name the request.
"""

import vllm.v1.worker.gpu_model_runner as gmr

if not getattr(gmr.GPUModelRunner, "_planted_swa_block_reused", False):
    _real = gmr.GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        ctx = self.compilation_config.static_forward_context
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens <= 0:
                continue
            for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
                spec = group.kv_cache_spec
                if type(spec).__name__ != "SlidingWindowSpec":
                    continue
                block = new.block_ids[gid][new.num_computed_tokens // spec.block_size - 1]
                for name in group.layer_names:
                    ctx[name].kv_cache[block].zero_()
        return _real(self, scheduler_output, *args, **kwargs)

    gmr.GPUModelRunner.execute_model = execute_model
    gmr.GPUModelRunner._planted_swa_block_reused = True
