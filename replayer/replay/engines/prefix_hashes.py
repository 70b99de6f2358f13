"""A prompt's block hashes, computed once per distinct chain of trace blocks.

vLLM hashes every prompt from its first token (``request_block_hasher``, a
left fold: hash ``j+1`` = H(hash ``j``, tokens of block ``j+1``, extra keys)).
A trace that names its prompts by block ids (``prompt_block_ids``, as the
Mooncake importer writes) repeats whole prefixes: over a third of the
conversation hour's 512-token blocks continue a chain seen before.

:class:`PrefixHashCache` stands in front of vLLM's own hasher and returns what
it would, without recomputing repeated chains. Why it is exact: a trace
block's tokens are a function of its id alone (:func:`traces.model.tokens.block_tokens`),
so when ``B`` (tokens per trace block) is a multiple of vLLM's hash block
size, the hashes inside trace block ``k`` depend only on the hash at its start
and its id, plus the extra keys vLLM adds. The cache is keyed by exactly that
(parent hash, or the cache salt for the first block; block id), is used only
where vLLM's extra keys are the salt on the first block and nothing else (no
LoRA, multimodal input or prompt embeddings) and no lookahead tokens enter a
hash, and everything not in it is computed by vLLM's hasher itself, resumed
from the last cached hash exactly where its loop would be. Entries are
least-recently-used, bounded so memory follows the KV-cache size, not the
trace length.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence


class PrefixHashCache:
    """Wraps vLLM's ``request_block_hasher``; used for a request only when told its blocks."""

    def __init__(self, hasher: Callable[[Any], list], hash_block_size: int,
                 lookahead_tokens: int, max_hashes: int) -> None:
        self.hasher = hasher
        self.hash_block_size = hash_block_size
        self.lookahead_tokens = lookahead_tokens
        self.max_hashes = max(1, max_hashes)   # hashes held, at most (LRU)
        self._held = 0
        self._chunks: OrderedDict[tuple[Any, int], tuple] = OrderedDict()
        # request id -> (trace block ids, tokens per trace block), until vLLM hashes it.
        self._pending: dict[str, tuple[Sequence[int], int]] = {}
        self.blocks_reused = 0          # vLLM hash blocks taken from the cache
        self.blocks_hashed = 0          # prompt hash blocks vLLM's hasher computed

    def usable(self, block_tokens: int) -> bool:
        return (self.lookahead_tokens == 0 and block_tokens > 0
                and block_tokens % self.hash_block_size == 0)

    def expect(self, request_id: str, block_ids: Sequence[int], block_tokens: int) -> None:
        """The next request ``request_id`` vLLM builds has these trace blocks."""
        if self.usable(block_tokens):
            self._pending[request_id] = (block_ids, block_tokens)

    def __call__(self, request: Any) -> list:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or request.block_hashes:
            return self.hasher(request)
        # From here on (decode tokens) vLLM's own hasher serves this request directly.
        request._block_hasher = self.hasher
        if (request.lora_request is not None or request.mm_features
                or getattr(request, "prompt_embeds", None) is not None):
            return self.hasher(request)
        block_ids, block_tokens = pending
        per = block_tokens // self.hash_block_size
        full = min(len(block_ids), request.num_prompt_tokens // block_tokens)
        chunks = self._chunks
        cached: list = []
        parent: Any = ("salt", request.cache_salt)   # what the first block's hash hangs on
        k = 0
        while k < full:
            chunk = chunks.get((parent, int(block_ids[k])))
            if chunk is None:
                break
            chunks.move_to_end((parent, int(block_ids[k])))
            cached.extend(chunk)
            parent = chunk[-1]
            k += 1
        own = request.block_hashes
        request.block_hashes = cached      # vLLM's loop resumes after the last cached hash
        try:
            rest = self.hasher(request)
        finally:
            request.block_hashes = own
        self.blocks_reused += len(cached)
        self.blocks_hashed += len(rest)
        hashes = cached + rest
        while k < full:
            chunk = tuple(hashes[k * per:(k + 1) * per])
            key = (parent, int(block_ids[k]))
            if key in chunks:           # its parent chunk had been evicted before it
                chunks.move_to_end(key)
            else:
                chunks[key] = chunk
                self._held += len(chunk)
            parent = chunk[-1]
            k += 1
        while self._held > self.max_hashes:
            self._held -= len(chunks.popitem(last=False)[1])
        return hashes
