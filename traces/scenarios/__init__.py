"""Hand-written YAML scenarios: compiled to traces (:mod:`.compile`), their
golden blocks rewritten in place (:mod:`.golden_writer`), and what-if engine
settings on any trace (:mod:`.what_if`). Imports :mod:`traces.model`,
:mod:`traces.io` and :mod:`traces.goldens`, never vLLM.
"""
