"""Tiny-model configs, one module an architecture family beyond the Llama and Qwen3-Next
that :mod:`replayer.replay.engines.worker.models` writes itself.

Each module turns a checked trace geometry into the ``config.json`` vLLM reads
for that family (and, where the family needs one, a kernel seam of its own);
``models`` chooses among them. Nothing here imports ``models`` (it imports these).
"""
