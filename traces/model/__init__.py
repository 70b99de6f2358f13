"""What a trace is: its schema, header engine block, events, outcomes and
tokens, with the bounds and checks every reader applies. The ground floor of
``traces``: imports nothing of it outside this package (the ``Trace`` it
validates is named for annotations only), and never vLLM.
"""
