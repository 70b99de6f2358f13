"""Mooncake's error codes and the store's error, for the replay side.

The codes are part of the data model (``store_ops.result``, a ``store_fault``
event's ``code``), so they live in :mod:`traces.model.store_codes`; this module
keeps the replay's imports where they were.
"""

from __future__ import annotations

from traces.model.store_codes import (  # noqa: F401
    CODES,
    CORRUPT,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    code_name,
)


class StoreError(RuntimeError):
    """The store failed: the replay stops, naming the store and the step."""
