"""The state digest that proves a time segment's boundary exact, one module a part.

:mod:`.walk` walks vLLM's objects by structure (what it cannot encode is an
error, so a boundary can only fail); :mod:`.release_0_33` and
:mod:`.release_0_29` (vLLM 0.26-0.32) say which of each release's objects are
state and which are excluded, and why; :mod:`.store` adds a MooncakeStore
connector's and the memory store's state, :mod:`.offload` vLLM's
OffloadingConnector's and its CPU tier's, :mod:`.events` what the targeted
events still to come (evict, store_remove, store_fault) read.
"""
