"""PLANTED FAULT (tests only; run in the engine process by PREFIX_REPLAYER_PLANT).

A NaN in the model's output: vLLM's runner hands back the prompt logprobs of
every request whose id starts with ``nan`` with a NaN at their last row. No hit
count changes. ``check --recompute`` must refuse to compare it (exit 2, naming
the request), never pass it: a NaN is never greater than a threshold.
"""

import vllm.v1.worker.gpu_model_runner as gmr

if not getattr(gmr.GPUModelRunner, "_planted_nan_prompt_logprobs", False):
    _real = gmr.GPUModelRunner._get_prompt_logprobs_dict

    def _get_prompt_logprobs_dict(self, *args, **kwargs):
        out = _real(self, *args, **kwargs)
        for rid, tensors in out.items():
            if rid.startswith("nan") and tensors is not None and len(tensors.logprobs):
                tensors.logprobs[-1, 0] = float("nan")
        return out

    gmr.GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    gmr.GPUModelRunner._planted_nan_prompt_logprobs = True
