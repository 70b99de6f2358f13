"""The warm server: vLLM imported once, a fresh fork of it for every replay.

``replayer server start`` runs :mod:`.server` in the background: a small
process (it never imports vLLM) that listens on a Unix socket of the user's
own (:mod:`.paths`) and keeps, per engine source and import-time
environment, one *engine parent* (:mod:`.engine_parent`): a process that has
imported vLLM, the adapter and everything a replay imports, and then only
forks. Each replay runs in a fresh fork of that pristine process, whose
state no other replay has touched, so a warm result is byte-identical to a
cold one. The client (:mod:`.client`) hands the server its connection and
its stderr; the fork answers on that connection with the frames of
:mod:`replayer.replay.execution.wire`. An engine parent whose sources changed is
replaced (:mod:`.fingerprint`); a server that is gone or cannot answer means
a cold start with one line on stderr.
"""
