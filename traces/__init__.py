"""Trace data: schemas, reading/writing, scenarios and importers.

Imports no vLLM: a trace can be read, inspected and converted on a machine
without it.
"""

from traces.model.errors import TraceError
from traces.model.schema import SCHEMA_VERSION
from traces.model.trace import Trace, read_trace, write_trace

__all__ = ["SCHEMA_VERSION", "Trace", "TraceError", "read_trace", "write_trace", "load_target"]


def load_target(path, *, stream=False):
    """A scenario file or a trace directory, as a validated :class:`Trace`;
    ``stream``: a directory's prompts read batch by batch by the replay
    (:func:`read_trace`)."""
    from pathlib import Path

    from traces.scenarios.compile import compile_scenario, is_scenario_path

    p = Path(path)
    if is_scenario_path(p):
        return compile_scenario(p)
    if not p.exists():
        raise TraceError(p, "no such file or directory")
    return read_trace(p, stream=stream)
