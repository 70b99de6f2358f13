"""Drives vLLM's own scheduler and KV-cache manager over a trace, compares with goldens."""
