"""The MooncakeStore connector as the replay drives it: the store adapter (vLLM's
own scheduler- and worker-side connector over the replay's store client, one
module per release range whose seams differ), its session and its ranks."""
