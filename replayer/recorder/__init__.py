"""Recording a running vLLM into a trace the replayer reads.

The hooks are vLLM's own extension points, never edits to vLLM:

* :mod:`.scheduler`: ``RecordingScheduler`` / ``RecordingAsyncScheduler``,
  named by ``--scheduler-cls``; requests as added, each step's schedule and
  accepted speculative tokens, outcomes from prefill stats, resets, aborts.
* :mod:`.connector`: loaded through ``kv_connector_module_path``; it hands
  vLLM a recording subclass of the real connector of the same name, which
  records every store lookup, put and get.

Recording is on when :data:`RECORD_ENV` (or ``kv_connector_extra_config``'s
``recorder_dir``) names an output directory; with neither, the hooks are
the plain vLLM classes' behaviour.

Before any of that, :mod:`.plugin` (a ``vllm.general_plugins`` entry point)
refuses a recording that cannot start, before the model loads. This package
imports nothing heavy itself, so the plugin costs a server that does not
record nothing.
"""

__all__ = ["RECORD_ENV", "record_dir"]


def __getattr__(name: str):
    if name in __all__:
        from replayer.recorder import session

        return getattr(session, name)
    raise AttributeError(name)
