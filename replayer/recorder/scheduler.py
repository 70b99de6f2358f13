"""The recording scheduler: vLLM's own ``Scheduler`` with a recorder beside it.

Install with ``--scheduler-cls replayer.recorder.scheduler.RecordingScheduler``
(``RecordingAsyncScheduler`` when async scheduling is on: vLLM turns async
scheduling off for a scheduler class that is not an ``AsyncScheduler``).
Every method calls vLLM's own first and only observes what it did; nothing
the scheduler decides changes. Recording is on when the output directory is
set (see :func:`.session.record_dir`); otherwise the class is vLLM's.

What becomes which table (the step clock is the number of ``schedule()``
calls so far, the replayer's clock):

* ``requests``: one row per request when it finishes or is aborted (its
  output is known only then), with ``arrival_step`` and ``arrival_order``
  from when it was added; rows of requests still running are written at
  shutdown.
* ``steps``: (step, id, num_scheduled_tokens, num_accepted_tokens) for
  every request scheduled, accepted drafts from the sampled tokens.
* ``outcomes``: each request's ``prefill_stats`` (cached, local, external).
* ``events``: successful ``reset_prefix_cache`` calls and aborts, at the
  step before which they happened.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from .header import recorded_header
from .session import SchedulerSession, record_dir, write_header


class SchedulerRecorder:
    """Turns scheduler calls into rows; holds only requests still alive."""

    def __init__(self, out: str, vllm_config: Any, kv_cache_config: Any) -> None:
        self.session = SchedulerSession(out)
        write_header(self.session.out, recorded_header(vllm_config, kv_cache_config))
        self.session.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0)
                                           or vllm_config.cache_config.block_size)
        if vllm_config.kv_transfer_config is not None:
            self.session.boundaries = {}
        w = self.session.writers
        self._requests, self._steps = w["requests"], w["steps"]
        self._outcomes, self._events = w["outcomes"], w["events"]
        self._live: dict[str, tuple[int, int, Any]] = {}   # id -> (arrival_step, order, request)
        self._order = 0
        self._pending: list[tuple[Any, int]] = []          # (scheduler_output, step)

    @property
    def step(self) -> int:
        return self.session.step

    def added(self, request: Any) -> None:
        rid = request.request_id
        if rid in self._live:            # a streaming continuation: same request
            return
        self._live[rid] = (self.session.step, self._order, request)
        self._order += 1
        self.session.add_boundaries(rid, request.block_hashes)

    def scheduled(self, so: Any) -> None:
        self._pending.append((so, self.session.step))
        self.session.step += 1

    def updated(self, so: Any, mro: Any, outputs: dict[int, Any]) -> None:
        step = None
        for i, (pso, pstep) in enumerate(self._pending):
            if pso is so:
                step = pstep
                del self._pending[: i + 1]
                break
        if step is not None and so.num_scheduled_tokens:
            ids = list(so.num_scheduled_tokens)
            spec = so.scheduled_spec_decode_tokens
            acc = None
            if spec:
                index = mro.req_id_to_index
                sampled = mro.sampled_token_ids
                acc = [None] * len(ids)
                for k, rid in enumerate(ids):
                    if spec.get(rid):
                        j = index.get(rid)
                        got = sampled[j] if j is not None and j < len(sampled) else None
                        acc[k] = max(len(got) - 1, 0) if got else None
            self._steps.extend({"step": [step] * len(ids), "id": ids,
                                "num_scheduled_tokens": list(so.num_scheduled_tokens.values()),
                                "num_accepted_tokens": acc}, len(ids))
        for eco in outputs.values():
            for out in eco.outputs:
                stats = out.prefill_stats
                if stats is not None:
                    self._outcomes.append({
                        "id": out.request_id, "num_prompt_tokens": stats.num_prompt_tokens,
                        "num_cached_tokens": stats.num_cached_tokens,
                        "num_local_cached_tokens": stats.num_local_cached_tokens,
                        "num_external_cached_tokens": stats.num_external_cached_tokens})
                if out.finish_reason is not None:
                    self.finished(out.request_id, aborted=False)

    def finished(self, rid: str, aborted: bool) -> None:
        entry = self._live.pop(rid, None)
        if entry is None:
            return
        arrival, order, req = entry
        prompt = req.prompt_token_ids
        if prompt is None:               # prompt embeddings: nothing to replay
            return
        out = list(req.output_token_ids)
        n_out = len(out)
        if aborted or n_out == 0:
            # Not finished by its own output: keep it running until the abort event.
            n_out = max(int(req.max_tokens), n_out, 1)
            out += [0] * (n_out - len(out))
        lora = getattr(req.lora_request, "lora_name", None) if req.lora_request else None
        self._requests.append({
            "id": rid, "arrival_step": arrival, "num_prompt_tokens": len(prompt),
            "prompt_tokens": prompt, "output_len": n_out, "output_tokens": out,
            "cache_salt": req.cache_salt, "lora_name": lora, "arrival_order": order},
            weight=1 + len(prompt) + n_out)

    def aborted(self, requests: list[Any]) -> None:
        for req in requests:
            self._events.append({"after": None, "at_step": self.session.step, "action": "abort",
                                 "target": req.request_id})
            self.finished(req.request_id, aborted=True)

    def reset(self, ok: bool) -> None:
        if ok:
            self._events.append({"after": None, "at_step": self.session.step,
                                 "action": "reset_prefix_cache", "target": None})

    def close(self) -> None:
        for rid in list(self._live):
            self.finished(rid, aborted=True)
        self.session.close()


class _Recording:
    """The hooks, shared by both scheduler classes (each calls vLLM's method first)."""

    _recorder: SchedulerRecorder | None = None
    record_to: str | None = None      # set on a subclass to record without env or config

    def _start_recording(self) -> None:
        out = self.record_to or record_dir(self.vllm_config)
        if out:
            self._recorder = SchedulerRecorder(out, self.vllm_config, self.kv_cache_config)

    def add_request(self, request) -> None:
        super().add_request(request)
        if self._recorder is not None:
            self._recorder.added(request)

    def schedule(self, *args, **kwargs):
        so = super().schedule(*args, **kwargs)
        if self._recorder is not None:
            self._recorder.scheduled(so)
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._recorder is not None:
            self._recorder.updated(scheduler_output, model_runner_output, outputs)
        return outputs

    def finish_requests(self, request_ids, finished_status):
        done = super().finish_requests(request_ids, finished_status)
        if self._recorder is not None and finished_status == RequestStatus.FINISHED_ABORTED:
            self._recorder.aborted(done)
        elif self._recorder is not None:
            for req in done:
                self._recorder.finished(req.request_id, aborted=True)
        return done

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        ok = super().reset_prefix_cache(reset_running_requests, reset_connector)
        if self._recorder is not None:
            self._recorder.reset(ok)
        return ok

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._recorder is not None:
                self._recorder.close()


class RecordingScheduler(_Recording, Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start_recording()


class RecordingAsyncScheduler(_Recording, AsyncScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start_recording()


def recording_scheduler_class(out: str, async_scheduling: bool = False) -> type:
    """A subclass that records to ``out`` whatever the environment says (the CPU replay)."""
    base = RecordingAsyncScheduler if async_scheduling else RecordingScheduler
    return type(base.__name__, (base,), {"record_to": str(out), "__module__": __name__})
