"""Store backends for the MooncakeStore connector replay.

``memory`` (default) is an in-process store with Mooncake's semantics;
``mooncake`` starts a real ``mooncake_master`` on loopback; ``mooncake://HOST:PORT``
uses one already running. Every backend sits behind :class:`RecordingStore`,
which writes each operation to the ``store_ops`` table.
"""

from replayer.replay.store.codes import StoreError, code_name
from replayer.replay.store.spec import StoreSpec, parse_store_spec

__all__ = ["StoreError", "StoreSpec", "code_name", "parse_store_spec"]
