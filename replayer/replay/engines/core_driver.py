"""vLLM's EngineCore over a null model: the part of an adapter no release changes.

From 0.29 to 0.33, what the replay touches of ``EngineCore`` is the same:
``EngineCore(vllm_config, executor_class, log_stats)``, requests in through
``preprocess_add_request`` and ``add_request``, ``step``/``post_step``,
``reset_prefix_cache(reset_running_requests, reset_connector)``,
``abort_requests``; the ``Executor`` base with its three abstract methods and
the worker calls EngineCore makes while it plans the KV cache; and the
``ModelRunnerOutput``, ``DraftTokenIds`` and ``EngineCoreOutput.prefill_stats``
dataclasses. That shared part lives here (its config objects and layer plan in
:mod:`.config.engine_config`). Everything that differs (config
fields, KV-cache spec constructors, what a release lacks) stays in the
adapter of each release range, which builds the config and the layer specs
and hands them to :class:`CoreEngine`.

An adapter that adds to a step (the 0.33 adapter's MooncakeStore connector,
its per-group hit explanation) overrides the small hooks of
:class:`CoreEngine` (``_kv_output``, ``_on_preprocessed``, ``_before_step``,
``_after_step``, ``_group_hits``) rather than copying the driver.

The one seam is the model: :class:`NullExecutor` stands where the GPU workers
would, reports the KV-cache layer specs the adapter built, and answers each
step with the trace's output tokens. Drafts are the true next tokens, so
every draft is accepted.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from replayer.replay.engines.base import (
    EngineAdapter,
    EngineInfo,
    EngineRequest,
    PrefillOutcome,
    StepResult,
    held_acceptance,
)
from replayer.replay.engines.prefix_hashes import PrefixHashCache
from replayer.replay.engines.top_logprobs import TopLogprobCollector


# The CoreEngine whose EngineCore is being built: EngineCore constructs the
# executor itself (``executor_class(vllm_config)``), so this is how the new
# executor instance finds its adapter; set only around that construction.
_BUILDING: ContextVar["CoreEngine"] = ContextVar("building_core_engine")


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f



class _Ready:
    """A step's model output, already computed, as ``execute_model(non_block=True)``
    hands it back: what EngineCore reads of that Future (``result()``, in
    ``step``, the only step function the replay calls; 0.29-0.33 alike),
    without a Future's lock and condition (~5 us a step)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value

    def done(self) -> bool:
        return True

    def exception(self, timeout: float | None = None) -> None:
        return None

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


class NullExecutor(Executor):
    """The model seam: no workers, no tensors; outputs come from the trace.

    ``collective_rpc`` answers the calls EngineCore makes while it plans the KV
    cache, as a single worker would.
    """

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.adapter: CoreEngine = _BUILDING.get()
        self.kv_cache_configs = None

    def check_health(self) -> None:
        return None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        name = method if isinstance(method, str) else method.__name__
        handler = getattr(self, f"_rpc_{name}", None)
        if handler is None:
            raise NotImplementedError(f"null executor: no worker call {name!r}")
        answer = handler(*args, **(kwargs or {}))
        # No worker compiles: no compile times to report (vLLM takes max() of them).
        result = [] if name == "compile_or_warm_up_model" else [answer]
        return _done(result) if non_block else result

    def _rpc_get_kv_cache_spec(self) -> dict[str, Any]:
        return dict(self.adapter.layer_specs)

    def _rpc_get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def _rpc_set_kv_cache_layout(self, *args: Any) -> None:
        return None

    def _rpc_determine_available_memory(self) -> int:
        # Large enough for any override; num_gpu_blocks_override decides.
        return 1 << 40

    def _rpc_initialize_from_config(self, kv_cache_configs: Any) -> None:
        self.kv_cache_configs = kv_cache_configs

    def _rpc_get_kv_connector_handshake_metadata(self) -> None:
        return None

    def _rpc_compile_or_warm_up_model(self) -> None:
        # 0.26's Executor.initialize_from_config asks the workers for their
        # compile times itself (later releases leave it to EngineCore, which
        # calls compile_or_warm_up_model below); collective_rpc answers none.
        return None

    def compile_or_warm_up_model(self) -> None:
        # The base class expects compile-time records from real workers.
        return None

    def execute_model(self, scheduler_output, non_block: bool = False):
        out = self.adapter._model_output(scheduler_output)
        return _Ready(out) if non_block else out

    def sample_tokens(self, grammar_output):  # pragma: no cover - execute_model never defers
        raise AssertionError("null executor never defers sampling")

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.adapter._drafts()

    def shutdown(self) -> None:
        return None


class _Timed:
    """Wraps a scheduler method to add up the seconds spent inside vLLM."""

    __slots__ = ("fn", "seconds")

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


class CoreEngine(EngineAdapter):
    """The real EngineCore, driven one step at a time by the replay loop.

    Every release it serves (0.26-0.33) publishes KV-cache events with their
    group (``group_idx``), so it supports them.

    ``config`` must name ``executor_cls`` (:class:`NullExecutor` or a subclass)
    as its distributed executor backend, which EngineCore then builds;
    ``layer_specs`` are the release's own KV-cache spec objects, which the
    executor reports.
    """

    supports_kv_events = True
    # 0.26-0.33's ModelRunnerOutput maps each request to its row
    # (``req_id_to_index``); 0.34 dropped the field, its scheduler reads the rows
    # in ``req_ids`` order. An adapter serving 0.34 sets this False.
    runner_output_index = True

    def __init__(self, config: Any, layer_specs: dict[str, Any], version: str,
                 executor_cls: type[NullExecutor] = NullExecutor) -> None:
        super().__init__()
        self.info = EngineInfo(vllm=version)
        self.layer_specs = layer_specs
        self.config = config
        self._step = 0
        # (step, request id) -> drafts accepted, from a recorded steps table.
        self._accepted: dict[tuple[str, int], int] | None = None
        self._verified: dict[str, int] = {}      # request -> steps with drafts verified
        self._outputs: dict[str, list[int]] = {}  # request id -> output tokens
        # A real model runner (replayer.replay.engines.worker) reports each forced token's
        # logprob; the null executor has none.
        self.wants_logprobs = getattr(executor_cls, "computes_logprobs", False)
        # The top-K distributions a replay asked for (ask_top_logprobs), where it did.
        self._top: TopLogprobCollector | None = None
        token = _BUILDING.set(self)
        try:
            # log_stats off: vLLM's per-step SchedulerStats, prefix-cache and
            # spec-decode counters and request timestamps feed metrics a replay
            # never reads. It is vLLM's own switch and changes no decision:
            # prefill_stats, the outcome the replay reports, is kept either way
            # (0.29-0.33 set it in schedule() whatever log_stats says).
            self.core = EngineCore(config, executor_cls, log_stats=False)
        finally:
            _BUILDING.reset(token)
        assert self.core.model_executor.adapter is self
        self.scheduler = self.core.scheduler
        self._schedule = _Timed(self.scheduler.schedule)
        self._update = _Timed(self.scheduler.update_from_output)
        self.scheduler.schedule = self._schedule  # type: ignore[method-assign]
        self.scheduler.update_from_output = self._update  # type: ignore[method-assign]
        self.num_spec = config.num_speculative_tokens if config.speculative_config else 0
        # In front of vLLM's request block hasher where an adapter installs it.
        self.prefix_hashes: PrefixHashCache | None = None
        self._sampled: list[str] = []
        # vLLM's targeted eviction (.block_evict), made when an evict event needs
        # it, and the requests whose cached blocks such events name.
        self.evictor = None
        self._evict_targets: frozenset[str] = frozenset()
        # vLLM's KV-cache events, where the config turns them on: the publisher
        # seam (ZMQ in production) fronted by an in-process collector.
        self._kv_events = None
        ev = getattr(config, "kv_events_config", None)
        if ev is not None and ev.enable_kv_cache_events:
            from replayer.replay.kv_events import KvEventCollector

            self._kv_events = KvEventCollector(self.scheduler, step=lambda: self._step - 1)

    # -- hooks for adapters that add to a step (no-ops here) --------------
    def _kv_output(self, scheduler_output) -> Any:
        """The step's KVConnectorOutput, where a connector runs."""
        return None

    def _on_preprocessed(self, req: Any, request: EngineRequest) -> None:
        """Sees vLLM's Request (block hashes computed) before it is added."""

    def _before_step(self) -> None:
        """Runs before each engine step."""

    def _after_step(self) -> None:
        """Runs after each engine step, before its outputs are read."""

    def _group_hits(self, request_id: str) -> tuple[int, ...] | None:
        """What each KV-cache group alone could have served, where known."""
        return None

    # -- the model seam -------------------------------------------------
    def _model_output(self, so) -> ModelRunnerOutput:
        scheduled = so.num_scheduled_tokens
        self._sampled = []
        kv_out = self._kv_output(so)
        if not scheduled:
            if kv_out is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput.with_kv_conn_output_only(kv_out)
        requests = self.scheduler.requests
        spec = so.scheduled_spec_decode_tokens
        req_ids = list(scheduled)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = requests[rid]
            # Schedule() has advanced num_computed_tokens: a request samples
            # once every known token (prompt and outputs so far) is computed.
            if req.num_computed_tokens >= req.num_tokens:
                n = req.num_output_tokens
                k = 1 + len(spec.get(rid, ()))
                if self._accepted is not None and k > 1:
                    i = self._verified.get(rid, 0)
                    self._verified[rid] = i + 1
                    k = 1 + held_acceptance(self._accepted, rid, i, k - 1)
                sampled.append(self._outputs[rid][n:n + k])
                self._sampled.append(rid)
            else:
                sampled.append([])
        extra = {} if kv_out is None else {"kv_connector_output": kv_out}
        if self.runner_output_index:
            extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)

    def _drafts(self) -> DraftTokenIds | None:
        if not self.num_spec or not self._sampled:
            return None
        requests = self.scheduler.requests
        ids, drafts = [], []
        for rid in self._sampled:
            req = requests.get(rid)
            if req is None or req.is_finished():
                continue
            n = req.num_output_tokens
            ids.append(rid)
            drafts.append(self._outputs[rid][n:n + self.num_spec])
        return DraftTokenIds(ids, drafts) if ids else None

    # -- the replay loop's interface -------------------------------------
    def _core_request(self, request: EngineRequest) -> EngineCoreRequest:
        logprobs: dict[str, Any] = {"logprobs": 0 if self.wants_logprobs else None}
        if self._top is not None:
            logprobs = self._top.sampling_args()
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0,
                                detokenize=False, **logprobs)
        if request.skip_reading_prefix_cache:    # recorded so: it never read the cache
            params.skip_reading_prefix_cache = True
        return EngineCoreRequest(
            request_id=request.id, prompt_token_ids=request.prompt_tokens, mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
            cache_salt=request.cache_salt, data_parallel_rank=None, priority=request.priority)

    def block_hashes_of(self, request: EngineRequest) -> list:
        """vLLM's block hashes of ``request`` with its whole output appended, from
        vLLM's own Request and hasher, without adding it: a time segment's digest
        reads which names a request's keys will get (digest/events.py)."""
        req, _ = self.core.preprocess_add_request(self._core_request(request))
        req.append_output_token_ids(list(request.output_tokens[:request.output_len]))
        return list(req.block_hashes)

    def add_request(self, request: EngineRequest) -> None:
        self._outputs[request.id] = request.output_tokens
        ecr = self._core_request(request)
        if self.prefix_hashes is not None and request.prompt_block_ids is not None:
            self.prefix_hashes.expect(request.id, request.prompt_block_ids,
                                      request.prompt_block_tokens)
        req, wave = self.core.preprocess_add_request(ecr)
        if request.id in self._evict_targets:
            self.evictor.track(req)
        if self._top is not None:
            self._top.added(request.id, req)
        self._on_preprocessed(req, request)
        self.core.add_request(req, wave)

    def step(self) -> StepResult:
        self._before_step()
        self._step += 1
        outputs, executed = self.core.step()
        self.core.post_step(executed)
        self._after_step()
        result = StepResult(executed=executed)
        for eco in outputs.values():
            for out in eco.outputs:
                stats = out.prefill_stats
                if stats is not None:
                    result.prefills.append(PrefillOutcome(
                        id=out.request_id, num_prompt_tokens=stats.num_prompt_tokens,
                        num_cached_tokens=stats.num_cached_tokens,
                        num_local_cached_tokens=stats.num_local_cached_tokens,
                        num_external_cached_tokens=stats.num_external_cached_tokens,
                        group_hits=self._group_hits(out.request_id)))
                if out.new_logprobs is not None:
                    result.logprobs.setdefault(out.request_id, []).extend(
                        float(row[0]) for row in out.new_logprobs.logprobs)
                if self._top is not None:
                    self._collect_top(out, result)
                if out.finish_reason is not None:
                    result.finished.append(out.request_id)
                    self._outputs.pop(out.request_id, None)
        return result

    def ask_top_logprobs(self, k: int | None) -> None:
        if self.wants_logprobs:
            self._top = None if k is None else TopLogprobCollector(k)

    def _collect_top(self, out: Any, result: StepResult) -> None:
        """One output's distributions (:mod:`.top_logprobs`)."""
        rid, top = out.request_id, self._top
        if out.prefill_stats is not None:
            top.prefilled(rid, out.prefill_stats.num_cached_tokens)
        if out.new_logprobs is not None:
            top.output_rows(rid, out.new_logprobs)
        if out.new_prompt_logprobs_tensors is not None:
            top.prompt_rows(rid, out.new_prompt_logprobs_tensors)
        if out.finish_reason is not None:
            result.distributions[rid] = top.finished(rid)

    def kv_event_rows(self) -> list[dict[str, Any]] | None:
        """The KV-cache events vLLM published, one row per block (None: events off)."""
        return None if self._kv_events is None else self._kv_events.as_dicts()

    # -- a time segment's naming logs (replayer.replay.segments.rows) -------
    def start_name_log(self) -> None:
        """A time segment's replay: log every naming of a block hash from now on,
        so the head names its rows as the exact path did (a segment that starts
        later cannot know which request first held a prefix)."""
        if self._kv_events is not None:
            self._kv_events.start_name_log()

    def segment_marks(self) -> dict[str, int]:
        """How far each naming log and the rows it names had come: where a
        segment's part of them begins or ends (empty: nothing named)."""
        ev = self._kv_events
        if ev is None or ev.name_log is None:
            return {}
        return {"kv_rows": len(ev.rows), "kv_names": len(ev.name_log)}

    def segment_logs(self) -> dict[str, Any]:
        """The naming logs, for the head (with the replay's result)."""
        ev = self._kv_events
        if ev is None or ev.name_log is None:
            return {}
        return {"kv_names": ev.name_log, "kv_row_names": ev.row_names}

    def hold_accepted(self, accepted: dict[tuple[str, int], int]) -> None:
        """Accept only as many drafts per verification as the recording did (its steps
        table): the i-th step in which a request has drafts scheduled gets the
        recording's i-th."""
        self._accepted = accepted
        self._verified = {}
        forced = getattr(self.core.model_executor, "forced", None)
        if forced is not None:                  # a real runner's draft seam holds them
            forced.accepted = accepted
            forced.verified = {}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_requests()

    def _evictor(self):
        """vLLM's targeted eviction (:mod:`.block_evict`), made when first needed."""
        if self.evictor is None:
            from replayer.replay.engines.block_evict import BlockEvictor

            self.evictor = BlockEvictor(self.scheduler, self.info.vllm)
        return self.evictor

    def track_blocks(self, request_ids: set[str]) -> None:
        self._evictor()
        self._evict_targets = frozenset(request_ids)

    def evict_cached_blocks(self, request: str | None, group: int | None) -> int:
        n = self._evictor().evict(request, group)
        self._recorded({"action": "evict", "target": request, "group": group})
        return n

    def _recorded(self, event: dict[str, Any]) -> None:
        """Tell a recorder installed on this engine about an event it cannot observe."""
        recorder = getattr(self.scheduler, "_recorder", None)
        if recorder is not None:
            recorder.ran(event)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests=False, reset_connector=False)

    def abort(self, request_id: str) -> None:
        self.core.abort_requests([request_id])
        self._outputs.pop(request_id, None)
        if self._top is not None:
            self._top.forget(request_id)

    def vllm_seconds(self) -> float:
        return self._schedule.seconds + self._update.seconds

    def hits_are_first_prefill(self) -> bool:
        # 0.29 to 0.33 alike: schedule() fills prefill_stats only while
        # num_preemptions <= 0 ("not post-preemption repeat prefills"), and
        # update_from_output hands it out once (take_prefill_stats).
        return True

    def close(self) -> None:
        from traces.io.parts import RecordingError

        try:
            self.core.shutdown()
        except RecordingError:
            # A recorder's last flush failed: the trace is incomplete. vLLM's shutdown
            # stopped at the scheduler; undo its gc.freeze() as it would have.
            import gc

            gc.unfreeze()
            raise
        except Exception:  # noqa: BLE001 - shutdown of a null executor has nothing to lose
            pass
