"""PLANTED FAULT (tests only; run in the engine process by PREFIX_REPLAYER_PLANT).

A store that hands back other bytes than were put: every successful get of the
in-memory store changes the first byte it wrote into the worker's KV buffer
(the model runner's KV tensors, on the model worker), as a transport that
delivered a damaged block would. Every hit count, key and lookup is unchanged;
only the loaded bytes differ from the put's. The replay's get-by-content check
(``RecordingStore``) must fail the replay, naming the key.
"""

import ctypes

import replayer.replay.store.memory as memory

if not getattr(memory.MemoryStore, "_planted_get_changes_a_byte", False):
    _real = memory.MemoryStore.batch_get_into_multi_buffers

    def batch_get_into_multi_buffers(self, keys, addrs, sizes, *args):
        results = _real(self, keys, addrs, sizes, *args)
        for result, key_addrs in zip(results, addrs):
            if result >= 0:
                byte = ctypes.c_ubyte.from_address(key_addrs[0])
                byte.value ^= 0xFF
        return results

    memory.MemoryStore.batch_get_into_multi_buffers = batch_get_into_multi_buffers
    memory.MemoryStore._planted_get_changes_a_byte = True
