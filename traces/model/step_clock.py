"""The step clock: how wall-clock arrivals of imported traces become engine steps.

One definition, read by the importer and documented in docs/scenarios.md: a request
that arrived at ``t`` milliseconds enters the engine before step
``t // step_ms``. An engine step stands for ``step_ms`` of production time
(20 ms by default, a typical decode step of a large model), so requests that
arrived within the same step window enter together, and an idle engine jumps
straight to the next arrival.
"""

from __future__ import annotations

import numpy as np

DEFAULT_STEP_MS = 20


def arrival_steps(arrival_ms: np.ndarray, step_ms: int = DEFAULT_STEP_MS) -> np.ndarray:
    if step_ms < 1:
        raise ValueError("step_ms must be >= 1")
    return np.asarray(arrival_ms, dtype=np.int64) // np.int64(step_ms)
