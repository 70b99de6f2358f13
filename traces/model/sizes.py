"""Sizes as people write them (``64MB``, ``1.5GB``, ``4096``), in bytes.

One parser for ``--store-capacity`` and the engine block's
``mooncake_global_segment_size``, so both accept and refuse the same text.
"""

from __future__ import annotations

import math

MAX_SIZE = 1 << 50
_UNITS = {"": 1, "b": 1, "kb": 1024, "mb": 1024 ** 2, "gb": 1024 ** 3}


def parse_size(text: str | int, what: str) -> int:
    """Bytes; ValueError names ``what`` (an option or key) and the text."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        t = str(text).strip().lower()
        num = t.rstrip("kmgb")
        unit = t[len(num):]
        try:
            value = float(num)
        except ValueError:
            value = -1
    if unit not in _UNITS or not value > 0 or not math.isfinite(value):   # nan, inf too
        raise ValueError(f"{what} {text!r}: expected a size such as 64MB or 2GB")
    size = int(value * _UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"{what} {text!r}: above the limit of 1 PiB")
    return size
