"""What-if geometry: ``--set engine.KEY=VALUE`` on a recorded trace.

A trace replays under another engine block (cache size, prefix-match unit,
retention interval, block size, speculative method, ...) with exactly the
validation a scenario's ``engine:`` gets: the changed block goes through
:meth:`traces.model.engine_spec.EngineBlock.from_dict`, so a bad key or value is one
line naming the option, never a replay that half-runs.

Values are YAML scalars or flow collections (``16``, ``true``, ``null``,
``{method: eagle, num_speculative_tokens: 1}``, ``[{kind: full_attention}]``);
``null`` is a given null where the engine block has a meaning for one (the
retention interval: dense checkpoints; ``hash_seed``: unset), and otherwise
leaves the key out (``speculative=null``: no speculative decoding). Dotted keys reach into mappings:
``engine.speculative.num_speculative_tokens=2``.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Sequence

import yaml

from traces.model.engine_spec import EngineBlock
from traces.model.errors import TraceError
from traces.trace import Trace


def _takes_null(key: str) -> bool:
    """Whether a given null means something for this key (the retention interval:
    dense checkpoints; hash_seed: unset), rather than leaving the key out."""
    for f in fields(EngineBlock):
        if f.name == key:
            return type(None) in f.metadata.get("types", ())
    return False


def parse_set(text: str) -> tuple[list[str], Any]:
    """``engine.a.b=VALUE`` -> (["a", "b"], parsed VALUE)."""
    where = f"--set {text}"
    key, sep, raw = text.partition("=")
    if not sep:
        raise TraceError(where, "expected engine.KEY=VALUE")
    path = key.strip().split(".")
    if len(path) < 2 or path[0] != "engine" or not all(path[1:]):
        raise TraceError(where, "the key must start with 'engine.' (e.g. engine.num_gpu_blocks)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TraceError(where, f"the value is not YAML: {problem}") from None
    return path[1:], value


def apply_sets(engine: EngineBlock, sets: Sequence[str]) -> EngineBlock:
    """``engine`` with every ``--set`` applied in order to what its header said,
    validated again as a scenario's engine block."""
    out = engine.to_header()
    for text in sets:
        path, value = parse_set(text)
        node = out
        for k in path[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise TraceError(f"--set {text}", f"engine.{'.'.join(path[:-1])} is not a mapping")
            node = child
        if value is None and len(path) == 1 and not _takes_null(path[0]):
            node.pop(path[0], None)            # left out: vLLM's default (speculative: off)
        else:
            node[path[-1]] = value
    label = "--set " + " ".join(sets)
    return EngineBlock.from_dict(label, out)


def with_sets(trace: Trace, sets: Sequence[str] | None) -> Trace:
    """The trace replayed under the changed engine block (unchanged when no sets)."""
    if not sets:
        return trace
    engine = replace(apply_sets(trace.engine, sets), allow_missing=trace.engine.allow_missing)
    return replace(trace, header={**trace.header, "engine": engine})
