"""The request stream: a slice of the Mooncake conversation trace, shrunk to run in minutes.

The source is the committed import of its first 500 requests
(``fixtures/traces/conversation_500``): arrival times in ms and prompts as
512-token hash-id blocks. Each hash id becomes ``tokens_per_block`` token ids
(:func:`traces.model.tokens.block_tokens`: equal ids at equal positions give equal
tokens), so the prefix structure is the trace's at a smaller scale; arrival
times are multiplied by ``time_scale``. Prompts longer than the server
allows are cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from replayer import SOURCE_ROOT
from traces.model.tokens import block_tokens

SOURCE = (SOURCE_ROOT / "fixtures" / "traces"
          / "conversation_500" / "requests.parquet")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class LiveRequest:
    name: str              # the request_id sent to the server ("r0007")
    arrival_s: float       # seconds after the first request
    prompt: list[int]
    max_tokens: int


def mooncake_stream(count: int, tokens_per_block: int, max_prompt: int, max_tokens: int,
                    start: int = 0, time_scale: float = 1.0, vocab_size: int = 32000,
                    source: Path = SOURCE) -> list[LiveRequest]:
    table = pq.read_table(source, columns=["arrival_ms", "num_prompt_tokens",
                                           "prompt_block_ids"]).slice(start, count).to_pydict()
    if len(table["arrival_ms"]) < count:
        raise ValueError(f"{source}: holds {start + len(table['arrival_ms'])} requests, "
                         f"asked for {count} from {start}")
    t0 = table["arrival_ms"][0]
    out = []
    for i, (ms, n, blocks) in enumerate(zip(table["arrival_ms"], table["num_prompt_tokens"],
                                            table["prompt_block_ids"])):
        length = min(max_prompt, math.ceil(n * tokens_per_block / MOONCAKE_BLOCK_TOKENS))
        # vocabulary ids from 100 up: clear of any special token of a tiny config
        tokens = block_tokens(blocks, tokens_per_block, length, vocab_size - 100) + 100
        out.append(LiveRequest(f"r{start + i:04d}", (ms - t0) / 1000.0 * time_scale,
                               tokens.tolist(), max_tokens))
    return out
