"""Goldens, one module per kind (request outcomes, store keys, KV events) over
what every kind shares (:mod:`.kind`: engine keys, where it lives). Imports
:mod:`traces.model` and :mod:`traces.io`, never vLLM.
"""
