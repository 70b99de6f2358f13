"""The replay: a trace's requests, events and store through vLLM's own engine.

Owns the replay loop (:mod:`.loop`), the step clock's event schedule
(:mod:`.schedule`) and its GC thresholds (:mod:`.gc_tuning`), KV-cache event
collection (:mod:`.kv_events`), the vLLM
adapters per release range (:mod:`.engines`), where an engine runs (in this
process, a child process, a warm server: :mod:`.execution`), the
MooncakeStore backends (:mod:`.store`) and replays split into time segments
that run at once, each proven exact at its boundary (:mod:`.segments`). It imports ``traces`` and vLLM, never
the CLI, the checks or the analyses built on it. Kept empty so that the
recorder, inside a serving vLLM, can import :mod:`.kv_events` without the loop.
"""
