"""The reference for the overhead target: the least code that can drive vLLM's scheduler.

Built from the same engine (so start-up is comparable), then only:
``Request`` creation (prompt hashing), ``schedule``, a fixed model output,
``update_from_output`` and, with EAGLE, the drafts. No replay bookkeeping, no
EngineCore step wrapper. Used only by ``replay_conversation.py``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack


def bare_loop(trace):
    t0 = time.perf_counter()
    from replayer.replay.execution.in_process import engine_here
    from traces.materialize import TokenSource, request_rows

    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    n_spec = trace.engine.num_speculative_tokens
    opened = ExitStack()
    eng = opened.enter_context(engine_here(trace))      # closed at the end
    core = eng.core
    sched = eng.scheduler
    hasher = core.request_block_hasher
    startup = time.perf_counter() - t0
    rows = request_rows(trace.requests)
    src = TokenSource(trace.header, trace.requests)
    order = sorted(range(len(rows.ids)), key=lambda i: (rows.arrival_step[i] or 0, i))
    outputs = {}
    ptr, clock, steps = 0, 0, 0
    prompt = cached = 0
    vllm_s = 0.0
    while True:
        while ptr < len(order) and (rows.arrival_step[order[ptr]] or 0) <= clock:
            i = order[ptr]
            ptr += 1
            rid = rows.ids[i]
            outputs[rid] = src.output(i, rows.output_len[i], n_spec + 1).tolist()
            ecr = EngineCoreRequest(
                request_id=rid, prompt_token_ids=src.prompt(i).tolist(), mm_features=None,
                sampling_params=SamplingParams(max_tokens=rows.output_len[i], ignore_eos=True,
                                               detokenize=False),
                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                data_parallel_rank=None)
            sched.add_request(Request.from_engine_core_request(ecr, hasher))
        if not sched.has_requests():
            if ptr >= len(order):
                break
            clock = max(clock, rows.arrival_step[order[ptr]] or 0)
            continue
        t = time.perf_counter()
        so = sched.schedule()
        vllm_s += time.perf_counter() - t
        sampled_ids = []
        if so.num_scheduled_tokens:
            reqs = sched.requests
            spec = so.scheduled_spec_decode_tokens
            ids = list(so.num_scheduled_tokens)
            toks = []
            for rid in ids:
                r = reqs[rid]
                if r.num_computed_tokens >= r.num_tokens:
                    n = r.num_output_tokens
                    toks.append(outputs[rid][n:n + 1 + len(spec.get(rid, ()))])
                    sampled_ids.append(rid)
                else:
                    toks.append([])
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                    sampled_token_ids=toks)
        else:
            mro = EMPTY_MODEL_RUNNER_OUTPUT
        t = time.perf_counter()
        outs = sched.update_from_output(so, mro)
        vllm_s += time.perf_counter() - t
        if n_spec and sampled_ids:
            reqs = sched.requests
            live = [rid for rid in sampled_ids if rid in reqs and not reqs[rid].is_finished()]
            if live:
                sched.update_draft_token_ids(DraftTokenIds(live, [
                    outputs[rid][reqs[rid].num_output_tokens:
                                 reqs[rid].num_output_tokens + n_spec] for rid in live]))
        for eco in outs.values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    prompt += o.prefill_stats.num_prompt_tokens
                    cached += o.prefill_stats.num_cached_tokens
        clock += 1
        steps += 1
    opened.close()
    return steps, round(cached / prompt, 6) if prompt else 0.0, vllm_s, startup
