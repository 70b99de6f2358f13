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
"""

from replayer.recorder.session import RECORD_ENV, record_dir

__all__ = ["RECORD_ENV", "record_dir"]
