"""What a trace is: its schema, header engine block, events, outcomes and
tokens, with the bounds and checks every reader applies. Imports nothing of
``traces.io``'s writers, the goldens or the scenarios, and never vLLM.
"""
