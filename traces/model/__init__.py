"""What a trace is: its schema, header engine block, events, outcomes and
tokens, with the bounds and checks every reader applies. The ground floor of
``traces``: imports nothing of it outside this package, and never vLLM
(a whole trace is validated beside ``Trace``, in :mod:`traces.trace`).
"""
