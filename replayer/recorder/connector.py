"""Recording every store operation of a KV connector, loaded by vLLM's own factory.

Use ``kv_connector_module_path: replayer.recorder.connector`` and keep
``kv_connector`` naming the real connector (``MooncakeStoreConnector``).
vLLM's factory then asks this module for that name, and gets (through the
module ``__getattr__``) a subclass of the real class: the class-level checks
vLLM makes (HMA support, KV layout, metrics) see the real connector, and
every method runs the real code. The subclass only:

* worker side: wraps the connector's store client in :class:`StoreOpRecorder`
  (key, group, token boundary, bytes, result of every exists, put and get)
  and marks ``batch_is_exist`` calls made by the worker's ``lookup`` as
  ``lookup``;
* scheduler side: stamps the step number on each step's connector
  metadata, so a worker in another process files its operations under the
  scheduler's step.

Recording is on when ``kv_connector_extra_config`` holds ``recorder_dir``
(or the environment sets ``PREFIX_REPLAYER_RECORD_DIR``).
"""

from __future__ import annotations

import threading
from typing import Any

from replayer.recorder.session import StoreSession, check_release, record_dir, scheduler_session
from replayer.replay.store.recording import key_group, key_hash

_CLASSES: dict[str, type] = {}


def _rank(vllm_config: Any) -> int:
    """The worker's global rank, as vLLM sets it on each worker's config (the replay
    sets it while it builds each rank's connector in one process)."""
    rank = getattr(getattr(vllm_config, "parallel_config", None), "rank", None)
    if isinstance(rank, int):
        return rank
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:  # noqa: BLE001 - no world group: a single rank
        return 0


class StoreOpRecorder:
    """A pass-through wrapper of the store client; each call becomes store_ops rows.

    No bytes are read (on a GPU the buffers are device memory): only sizes.
    """

    def __init__(self, inner: Any, session: StoreSession, rank: int, out: str) -> None:
        self._inner = inner
        self._writer = session.writer
        self._out = out
        self.rank = rank
        self.step = 0
        self.phase = "exists"
        self._order = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _rows(self, op: str, keys, sizes, results) -> None:
        sched = scheduler_session(self._out)
        where = sched.boundaries if sched is not None and sched.boundaries is not None else {}
        step = self.step + 1 if op == "lookup" else self.step
        with self._lock:
            for i, k in enumerate(keys):
                site = where.get(key_hash(k))
                self._writer.append({
                    "order": self._order, "step": step, "rank": self.rank, "op": op, "key": k,
                    "group": key_group(k), "boundary": site[0] if site else None,
                    "bytes": None if sizes is None else int(sum(sizes[i])),
                    "result": int(results[i]), "request": site[1] if site else None})
                self._order += 1

    def batch_is_exist(self, keys):
        res = self._inner.batch_is_exist(keys)
        self._rows(self.phase, keys, None, res)
        return res

    def batch_put_from_multi_buffers(self, keys, addrs, sizes, *args, **kwargs):
        res = self._inner.batch_put_from_multi_buffers(keys, addrs, sizes, *args, **kwargs)
        self._rows("put", keys, sizes, res)
        return res

    def batch_get_into_multi_buffers(self, keys, addrs, sizes, *args, **kwargs):
        res = self._inner.batch_get_into_multi_buffers(keys, addrs, sizes, *args, **kwargs)
        self._rows("get", keys, sizes, res)
        return res

    def remove_all(self, *args, **kwargs):
        res = self._inner.remove_all(*args, **kwargs)
        with self._lock:
            self._writer.append({"order": self._order, "step": self.step, "rank": self.rank,
                                 "op": "remove_all", "key": None, "group": None,
                                 "boundary": None, "bytes": None, "result": int(res),
                                 "request": None})
            self._order += 1
        return res

    def remove(self, key, *args, **kwargs):
        """One key removed (the replay's ``store_remove``; an operator's tooling)."""
        res = self._inner.remove(key, *args, **kwargs)
        self._rows("remove", [key], None, [res])
        return res


class RecordingConnectorMixin:
    """Placed before the real connector class in a generated subclass."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._rec_builds = 0
        self._rec_bound = -1
        self._rec_store: StoreOpRecorder | None = None
        self._rec_session: StoreSession | None = None
        out = record_dir(vllm_config)
        worker = getattr(self, "connector_worker", None)
        if out and worker is not None and getattr(worker, "store", None) is not None:
            import vllm

            check_release(vllm.__version__, connector=True)
            rank = _rank(vllm_config)
            self._rec_session = StoreSession(out, rank)
            self._rec_store = StoreOpRecorder(worker.store, self._rec_session, rank, out)
            worker.store = self._rec_store
            lookup = worker.lookup
            recorder = self._rec_store

            def recorded_lookup(*args, **kwargs):
                recorder.phase = "lookup"
                try:
                    return lookup(*args, **kwargs)
                finally:
                    recorder.phase = "exists"

            worker.lookup = recorded_lookup

    # -- scheduler side: the step clock travels with the metadata ---------
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        try:
            meta.recorder_step = self._rec_builds
        except AttributeError:          # slotted metadata: the worker counts steps itself
            pass
        self._rec_builds += 1
        return meta

    # -- worker side -----------------------------------------------------
    def bind_connector_metadata(self, connector_metadata) -> None:
        step = getattr(connector_metadata, "recorder_step", None)
        self._rec_bound = step if step is not None else self._rec_bound + 1
        if self._rec_store is not None:
            self._rec_store.step = self._rec_bound
        super().bind_connector_metadata(connector_metadata)

    def shutdown(self):
        try:
            return super().shutdown()
        finally:
            session = getattr(self, "_rec_session", None)   # None if __init__ failed early
            if session is not None:
                session.close()


def recording_class(name: str) -> type:
    """The recording subclass of vLLM's registered connector ``name``."""
    if name not in _CLASSES:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        real = KVConnectorFactory.get_connector_class_by_name(name)
        _CLASSES[name] = type(name, (RecordingConnectorMixin, real),
                              {"__module__": __name__, "__doc__": real.__doc__})
    return _CLASSES[name]


def __getattr__(name: str) -> type:
    """``getattr(module, "MooncakeStoreConnector")`` as vLLM's factory does it."""
    if name.startswith("_") or not name[:1].isupper():
        raise AttributeError(name)
    try:
        return recording_class(name)
    except ValueError as exc:
        raise AttributeError(f"{name}: {exc}") from None
