"""Real models' KV-cache geometry, derived by vLLM's own code.

A replay's engine block states its groups and block sizes; for a model whose
sizes vLLM computes (a hybrid model's attention block is stretched until its
page covers a Mamba state), a module here runs the vLLM functions that compute
them on the model's config, so a fixture's numbers can be checked against
vLLM rather than copied from a log. Nothing here runs during a replay: the
derivation imports the model's vLLM module (seconds), a replay only reads the
engine block.
"""
