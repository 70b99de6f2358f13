"""The recording scheduler: vLLM's own ``Scheduler`` with a recorder beside it.

Install with ``--scheduler-cls replayer.recorder.scheduler.RecordingScheduler``
(``RecordingAsyncScheduler`` when async scheduling is on: vLLM turns async
scheduling off for a scheduler class that is not an ``AsyncScheduler``).
Every method calls vLLM's own first and only observes what it did; nothing
the scheduler decides changes. Recording is on when the output directory is
set (see :func:`.session.record_dir`, or :func:`record_into` for the replay's
own engines); otherwise the class is vLLM's.

What becomes which table (the step clock is the number of ``schedule()``
calls so far, the replayer's clock):

* ``requests``: one row per request when it is added (prompt packed while
  vLLM has just hashed it, ``output_len`` its ``max_tokens`` until known),
  so a kill loses no request that was running;
* ``finishes``: its output when vLLM frees it (finished or aborted). The
  reader folds these into ``requests``; a request with none was still
  running when the recording ended, and the replay aborts it there. The
  recorder never keeps vLLM's ``Request`` alive.
* ``steps``: (step, id, num_scheduled_tokens, num_accepted_tokens) for
  every request scheduled, accepted drafts from the sampled tokens.
* ``outcomes``: each request's ``prefill_stats`` (cached, local, external).
* ``events``: successful ``reset_prefix_cache`` calls and aborts, at the
  step before which they happened; and the ``evict`` and ``store_remove``
  events a replay ran (the engine reports them: :meth:`SchedulerRecorder.ran`).
* ``kv_events``: where the server publishes KV-cache events
  (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``), every
  block of every batch the scheduler publishes, named by group, boundary and
  first request (:mod:`replayer.replay.kv_events`, which stands in front of
  the configured publisher and hands every batch on to it).
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from replayer.recorder.header import recorded_header
from replayer.recorder.session import SchedulerSession, check_release, record_dir, write_header
from traces.io.parts import pack_tokens
from traces.model.schema import OUTCOME_FIELDS

_RANDOM_SUFFIX = re.compile(r"^(?P<external>.+)-[0-9a-f]{8}$")


def external_id(request_id: str) -> str | None:
    """The id the front end gave vLLM, which names the client's response: vLLM's
    ``InputProcessor.assign_request_id`` (0.29-0.33) appends ``-`` and 8 random hex
    characters to it unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set. None
    when the id does not have that form (a request added to the engine directly)."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return request_id
    m = _RANDOM_SUFFIX.match(request_id)
    return m.group("external") if m else None


def mm_inputs(features: Any) -> list[dict[str, Any]] | None:
    """A request's multimodal items as its block hashes see them (identifier and
    placeholder position: ``kv_cache_utils._gen_mm_extra_hash_keys``); None without."""
    if not features:
        return None
    return [{"identifier": f.identifier, "offset": f.mm_position.offset,
             "length": f.mm_position.length} for f in features]


class SchedulerRecorder:
    """Turns scheduler calls into rows; holds only requests still alive."""

    def __init__(self, out: str, vllm_config: Any, kv_cache_config: Any) -> None:
        import vllm

        adapter = check_release(vllm.__version__,
                                connector=vllm_config.kv_transfer_config is not None)
        self._adapter = adapter              # the release's names (output rows, cache skip)
        self.session = SchedulerSession(out)
        write_header(self.session.out, recorded_header(vllm_config, kv_cache_config, adapter))
        self.session.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0)
                                           or vllm_config.cache_config.block_size)
        if vllm_config.kv_transfer_config is not None:
            self.session.boundaries = {}
        w = self.session.writers
        self._requests, self._steps = w["requests"], w["steps"]
        self._outcomes, self._events = w["outcomes"], w["events"]
        self._finishes = w["finishes"]
        self._live: dict[str, int] = {}        # id -> max_tokens, while vLLM holds it
        self._named: dict[str, int] = {}       # id -> its block hashes filed, while live
        self._order = 0
        self._pending: list[tuple[Any, int]] = []          # (scheduler_output, step)
        self._update_step: int | None = None   # inside update_from_output: its step
        self.external_finish = False      # inside finish_requests: not finished by its output

    @property
    def step(self) -> int:
        return self.session.step

    def added(self, request: Any) -> None:
        rid = request.request_id
        if rid in self._live:            # a streaming continuation: same request
            return
        prompt = request.prompt_token_ids
        if prompt is None:               # prompt embeddings: nothing to replay
            return
        lora = request.lora_request
        n_prompt = len(prompt)
        self._live[rid] = request.max_tokens
        self._requests.append({
            "id": rid, "arrival_step": self.session.step, "num_prompt_tokens": n_prompt,
            # Packed now, while vLLM has just read (hashed) these tokens and they
            # are still in the CPU cache: later the same packing costs 2-3x more.
            "prompt_tokens": pack_tokens(prompt), "output_len": request.max_tokens,
            "cache_salt": request.cache_salt, "lora_name": lora.lora_name if lora else None,
            "priority": request.priority or None, "arrival_order": self._order,
            "external_id": external_id(rid),
            # The fields that change what the request reads from the cache
            # (docs/recording.md, "Request fields"): null where they do not.
            "skip_reading_prefix_cache": True if self._adapter.skips_prefix_cache(request)
                                         else None,
            "mm_inputs": mm_inputs(request.mm_features)},
            weight=1 + n_prompt)
        self._order += 1
        self.session.add_boundaries(rid, request.block_hashes)
        self._named[rid] = len(request.block_hashes)

    def scheduled(self, so: Any, running: Any = ()) -> None:
        """A step scheduled; ``running``: vLLM's running requests, whose blocks
        filled while they decode got their hashes after ``added`` (vLLM appends
        to ``Request.block_hashes`` with the output tokens): filed now, before
        this step's puts, so a decode put names its request and boundary too."""
        if self.session.boundaries is not None:
            for req in running:
                named = self._named.get(req.request_id)
                if named is not None and len(req.block_hashes) > named:
                    self.session.add_boundaries(req.request_id, req.block_hashes, named)
                    self._named[req.request_id] = len(req.block_hashes)
        self._pending.append((so, self.session.step))
        self.session.step += 1

    def updating(self, so: Any) -> None:
        """Before vLLM's update of ``so``: which step it is (rows it frees name it)."""
        pending = self._pending
        self._update_step = None
        for i, (pso, pstep) in enumerate(pending):
            if pso is so:
                self._update_step = pstep
                del pending[: i + 1]
                break

    def updated(self, so: Any, mro: Any, outputs: dict[int, Any]) -> None:
        # Runs every step on the engine's thread: the step's rows go straight
        # into the writer's column lists, and nothing made here outlives the call.
        step = self._update_step
        nst = so.num_scheduled_tokens
        if step is not None and nst:
            acc = self._accepted(so, mro) if so.scheduled_spec_decode_tokens else None
            self._steps.extend({"step": step, "id": nst.keys(),
                                "num_scheduled_tokens": nst.values(),
                                "num_accepted_tokens": acc}, len(nst))
        for eco in outputs.values():
            for out in eco.outputs:
                stats = out.prefill_stats
                if stats is not None:
                    # vLLM's PrefillStats names its fields as the outcomes table does.
                    row = {f: getattr(stats, f) for f in OUTCOME_FIELDS}
                    row["id"] = out.request_id
                    row["step"] = step
                    self._outcomes.append(row)
        if step is not None:
            # Every row of this step is handed over: parts flushed from now on
            # say the recording is whole through it (traces/model/recording_cut.py).
            self.session.done_step = step
        self._update_step = None

    def _accepted(self, so: Any, mro: Any) -> list[int | None]:
        """Accepted draft tokens per scheduled request (None where none were proposed)."""
        spec = so.scheduled_spec_decode_tokens
        index = self._adapter.output_rows(mro)
        sampled = mro.sampled_token_ids
        acc: list[int | None] = []
        for rid in so.num_scheduled_tokens:
            got = None
            if spec.get(rid):
                j = index.get(rid)
                got = sampled[j] if j is not None and j < len(sampled) else None
            acc.append(max(len(got) - 1, 0) if got else None)
        return acc

    def finished(self, request: Any) -> None:
        """A request vLLM frees: its output, now known."""
        self._named.pop(request.request_id, None)
        max_tokens = self._live.pop(request.request_id, None)
        if max_tokens is None:
            return
        out = pack_tokens(request.output_token_ids)
        n_out = len(out) >> 2
        if self.external_finish or n_out == 0 or request.status == RequestStatus.FINISHED_ABORTED:
            # Not finished by its own output: keep it running until the abort event.
            pad = max(int(max_tokens), n_out, 1) - n_out
            out += bytes(4 * pad)
            n_out += pad
        step = self._update_step if self._update_step is not None else self.session.step
        self._finishes.append({"id": request.request_id, "output_len": n_out,
                               "output_tokens": out, "step": step}, weight=1 + n_out)

    def aborted(self, requests: list[Any]) -> None:
        for req in requests:
            self._events.append({"after": None, "at_step": self.session.step, "action": "abort",
                                 "target": req.request_id})

    def reset(self, ok: bool) -> None:
        if ok:
            self._events.append({"after": None, "at_step": self.session.step,
                                 "action": "reset_prefix_cache", "target": None})

    def watch_kv_events(self, scheduler: Any) -> None:
        """Record the KV-cache events ``scheduler`` publishes, if it publishes any."""
        cfg = getattr(scheduler, "kv_events_config", None)
        if cfg is None or not cfg.enable_kv_cache_events:
            return
        from replayer.replay.kv_events import KvEventCollector
        from traces.model.schema import KV_EVENTS

        writer = self.session.add_table(KV_EVENTS)
        # Published in update_from_output, after schedule() moved the clock on.
        KvEventCollector(scheduler, step=lambda: self.session.step - 1, sink=writer.append)

    def ran(self, event: dict[str, Any]) -> None:
        """A targeted event the replay ran on this engine (``evict``, ``store_remove``:
        no vLLM entry point to observe), so a replay of the recording runs it too."""
        self._events.append({"after": None, "at_step": self.session.step, "target": None,
                             "group": None, "keys": None, **event})

    def close(self) -> None:
        """The last flush. Requests still running get no finish row: the reader
        ends them where the recording ended, as after a kill."""
        self.session.close()


# Where the replay's own engines record (:func:`record_into`), by ``id`` of their
# vLLM config (with a weak reference, so a later config at a freed id is not
# taken for it): taken by the scheduler built for that config. Kept here, not
# on a class made per call, because vLLM's multiprocess executor pickles the
# config (its ``scheduler_cls`` with it) for its rank processes at TP > 1, and a
# class pickles by its module-level name.
_RECORD_TO: dict[int, tuple[weakref.ref[Any], str]] = {}


def record_into(vllm_config: Any, out: str) -> type:
    """The scheduler class that records the engine built for ``vllm_config`` into
    ``out`` whatever the environment says (the CPU replay): one of the two
    module-level classes, ``out`` kept here for that config."""
    _RECORD_TO[id(vllm_config)] = (weakref.ref(vllm_config), str(out))
    async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
    return RecordingAsyncScheduler if async_scheduling else RecordingScheduler


def _recording_to(vllm_config: Any) -> str | None:
    """Where :func:`record_into` said ``vllm_config``'s engine records, once."""
    ref, out = _RECORD_TO.pop(id(vllm_config), (None, None))
    return out if ref is not None and ref() is vllm_config else None


class _Recording:
    """The hooks, shared by both scheduler classes (each calls vLLM's method first)."""

    _recorder: SchedulerRecorder | None = None

    def _start_recording(self) -> None:
        out = _recording_to(self.vllm_config) or record_dir(self.vllm_config)
        if out:
            self._recorder = SchedulerRecorder(out, self.vllm_config, self.kv_cache_config)
            self._recorder.watch_kv_events(self)

    def add_request(self, request) -> None:
        super().add_request(request)
        if self._recorder is not None:
            self._recorder.added(request)

    def schedule(self, *args, **kwargs):
        so = super().schedule(*args, **kwargs)
        if self._recorder is not None:
            self._recorder.scheduled(so, self.running)
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        if self._recorder is not None:
            self._recorder.updating(scheduler_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._recorder is not None:
            self._recorder.updated(scheduler_output, model_runner_output, outputs)
        return outputs

    def finish_requests(self, request_ids, finished_status):
        rec = self._recorder
        if rec is None:
            return super().finish_requests(request_ids, finished_status)
        rec.external_finish = True        # rows are written by _free_request below
        try:
            done = super().finish_requests(request_ids, finished_status)
        finally:
            rec.external_finish = False
        if finished_status == RequestStatus.FINISHED_ABORTED:
            rec.aborted(done)
        return done

    def _free_request(self, request, *args, **kwargs):
        if self._recorder is not None:
            self._recorder.finished(request)
        return super()._free_request(request, *args, **kwargs)

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
