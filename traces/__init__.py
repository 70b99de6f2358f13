"""Trace data: schemas, reading/writing, scenarios and importers.

Imports no vLLM: a trace can be read, inspected and converted on a machine
without it. Rooms, each importing only those below it (``tests/test_layout.py``):
:mod:`.scenarios` and :mod:`.importers` (sources that become traces);
:mod:`.reachable` (the hits a trace alone allows); :mod:`.trace` (one trace
directory read and written whole) and :mod:`.materialize` (its prompts as
token arrays); :mod:`.io` (files) and :mod:`.goldens`; :mod:`.model` (what a
trace is).
"""

from traces.model.errors import TraceError
from traces.model.schema import SCHEMA_VERSION
from traces.trace import Trace, read_trace, write_trace

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
