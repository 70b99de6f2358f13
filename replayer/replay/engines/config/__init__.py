"""vLLM's config objects from a trace's engine block, and vLLM's config errors in its terms.

:mod:`.engine_config` builds what every release range shares (the tiny model
directories, ``CacheConfig``/``SchedulerConfig`` arguments by vLLM's names,
one ``VllmConfig``, the plan of KV-cache layers) and names each setting per
release (``SETTINGS``); :mod:`.errors` turns vLLM's pydantic errors into one
line naming the trace's engine field. Imports only ``engines.base`` (its
errors) from the package above; the adapters import this, never the reverse.
"""
