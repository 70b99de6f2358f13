"""Mooncake's error codes by name: the store reports ints, users read names.

The values are Mooncake's ``ErrorCode`` enum (mooncake-store/include/types.h).
A ``store_fault`` event names one (``code: NO_AVAILABLE_HANDLE``) or gives it
as a number.
"""

from __future__ import annotations

CODES = {
    0: "OK", -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND", -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION", -400: "INVALID_KEY",
    -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK", -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS", -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1000: "ETCD_OPERATION_ERROR", -1100: "FILE_NOT_FOUND",
}

# Not Mooncake's: a ``store_fault`` code the replay gives itself. A get it takes
# succeeds with another key's bytes (the same size, put earlier), as a store
# that mixed up two objects would: what ``check --recompute`` must catch.
CORRUPT = -99_999
REPLAY_CODES = {CORRUPT: "CORRUPT"}

_BY_NAME = {name: code for code, name in {**CODES, **REPLAY_CODES}.items() if code < 0}

NO_AVAILABLE_HANDLE = -200          # the pool is full: vLLM's worker calls it store pressure
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
RPC_FAIL = -900


def code_name(code: int) -> str:
    return f"{CODES.get(code) or REPLAY_CODES.get(code, 'UNKNOWN')} ({code})"


def code_of(value: object) -> int | None:
    """A code given by name (``RPC_FAIL``) or number (-900); None if unknown or >= 0."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value < 0 else None
    if isinstance(value, str):
        return _BY_NAME.get(value.strip().upper())
    return None
