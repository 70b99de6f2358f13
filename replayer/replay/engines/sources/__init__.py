"""Where an engine's vLLM comes from: a published release (fetched once), a source
tree or one of its commits, a Python environment of the user's, and the spec text
(``--engine``) that names one of them."""
