"""The in-memory store keeps Mooncake's semantics, moving real bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from replayer.replay.store.codes import OBJECT_NOT_FOUND, code_name
from replayer.replay.store.memory import MemoryStore
from replayer.replay.store.recording import RecordingStore, key_group, key_hash
from replayer.replay.store.spec import parse_size, parse_store_spec


def buf(values):
    a = np.array(values, dtype=np.uint8)
    return a, [a.ctypes.data], [a.nbytes]


def test_put_get_moves_bytes_and_duplicate_put_keeps_first():
    s = MemoryStore()
    a, addrs, sizes = buf([1, 2, 3, 4])
    assert s.batch_put_from_multi_buffers(["k"], [addrs], [sizes]) == [0]
    b, baddrs, bsizes = buf([9, 9, 9, 9])
    assert s.batch_put_from_multi_buffers(["k"], [baddrs], [bsizes]) == [0]   # kept first
    out, oaddrs, osizes = buf([0, 0, 0, 0])
    assert s.batch_get_into_multi_buffers(["k"], [oaddrs], [osizes]) == [4]
    assert out.tolist() == [1, 2, 3, 4]
    assert s.batch_is_exist(["k", "missing"]) == [1, 0]


def test_get_of_missing_key_is_object_not_found():
    s = MemoryStore()
    out, addrs, sizes = buf([7, 7])
    assert s.batch_get_into_multi_buffers(["nope"], [addrs], [sizes]) == [OBJECT_NOT_FOUND]
    assert out.tolist() == [7, 7]                       # untouched
    assert code_name(OBJECT_NOT_FOUND) == "OBJECT_NOT_FOUND (-704)"


def test_capacity_evicts_oldest_first_and_records_it():
    rec = RecordingStore(MemoryStore(capacity_bytes=8), "memory")
    for i in range(3):
        a, addrs, sizes = buf([i] * 4)
        rec.batch_put_from_multi_buffers([f"k{i}"], [addrs], [sizes])
    assert rec.batch_is_exist(["k0", "k1", "k2"]) == [0, 1, 1]
    ops = [(r["op"], r["key"]) for r in rec.ops.rows]
    assert ops[:4] == [("put", "k0"), ("put", "k1"), ("evict", "k0"), ("put", "k2")]
    assert [r["order"] for r in rec.ops.rows] == list(range(len(rec.ops.rows)))


def test_a_key_put_again_after_its_eviction_is_read_back_as_put_again():
    # The model worker's blocks hold real KV: a prefix put again from another block
    # after its eviction may carry other bytes, and that value is what a get reads.
    rec = RecordingStore(MemoryStore(capacity_bytes=8), "memory")
    for key, value in (("k", 1), ("other", 2), ("more", 3), ("k", 4)):
        a, addrs, sizes = buf([value] * 4)
        rec.batch_put_from_multi_buffers([key], [addrs], [sizes])
    out, oaddrs, osizes = buf([0] * 4)
    assert rec.batch_get_into_multi_buffers(["k"], [oaddrs], [osizes]) == [4]
    assert out.tolist() == [4] * 4
    assert rec.take_failures() == [] and rec.ops.gets_checked == 1


def test_recording_store_flags_bytes_that_differ_and_error_codes():
    class Liar(MemoryStore):
        def batch_get_into_multi_buffers(self, keys, addrs, sizes, *a):
            for k, ad, sz in zip(keys, addrs, sizes):
                ctypes.memset(ad[0], 0xAB, sz[0])
            return [sz[0] for sz in sizes]

        def batch_is_exist(self, keys):
            return [-900 for _ in keys]

    rec = RecordingStore(Liar(), "memory")
    rec.step = 5
    a, addrs, sizes = buf([1, 2, 3])
    rec.batch_put_from_multi_buffers(["k"], [addrs], [sizes])
    out, oaddrs, osizes = buf([0, 0, 0])
    rec.batch_get_into_multi_buffers(["k"], [oaddrs], [osizes])
    rec.batch_is_exist(["k"])
    failures = rec.take_failures()
    assert failures[0] == "store memory: get of k read back bytes that differ from the put at step 5"
    assert failures[1] == "store memory: exists of k returned RPC_FAIL (-900) at step 5"
    assert rec.take_failures() == []


def test_key_parts():
    key = "tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@ab12"
    assert key_group(key) == 1 and key_hash(key) == "ab12"


def test_store_specs_and_sizes():
    assert parse_store_spec("memory").kind == "memory"
    spec = parse_store_spec("mooncake://127.0.0.1:50051")
    assert (spec.kind, spec.host, spec.port) == ("mooncake", "127.0.0.1", 50051)
    assert parse_store_spec("mooncake", "64MB").capacity_bytes == 64 * 1024 ** 2
    assert parse_size("1.5kb") == 1536
    for bad in ("redis", "mooncake://nohost", "mooncake://h:99999"):
        with pytest.raises(ValueError, match="--store"):
            parse_store_spec(bad)
