"""Turning a trace's requests table into the token ids an engine receives.

The one definition of a request's tokens, whichever form the trace stores:
explicit ``prompt_tokens``, or ``prompt_block_ids`` synthesised per block.
Tokens are made one request at a time, when it arrives, so a replay of the
whole conversation trace never holds 145 M tokens at once; the other columns
stay Arrow arrays read one value at a time, so a day of traffic does not
become a million Python objects either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .tokens import block_tokens, stream_tokens


def _list_column(table: pa.Table, name: str):
    """(offsets, values, validity) of a list column, as numpy, or None if absent."""
    if name not in table.column_names:
        return None
    arr = table[name].combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # pragma: no cover - pyarrow < 15
        arr = arr.chunk(0) if arr.num_chunks else pa.array([], arr.type)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return offsets, values, valid


class Column(Sequence):
    """One column of the requests table, read a value at a time (Python values,
    None for nulls) without turning the whole column into Python objects."""

    def __init__(self, table: pa.Table, name: str) -> None:
        self._n = table.num_rows
        self._arr = table[name].combine_chunks() if name in table.column_names else None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return None if self._arr is None else self._arr[i].as_py()

    def __iter__(self):
        if self._arr is None:
            return iter([None] * self._n)
        return (self._arr[i].as_py() for i in range(self._n))


@dataclass
class RequestRows:
    """The requests table's columns the replay loop reads, by row."""

    ids: Column
    arrival_step: Column
    after: Column
    num_prompt_tokens: Column
    output_len: Column
    cache_salt: Column
    lora_name: Column
    priority: Column


class TokenSource:
    """Prompt and output tokens of each request row."""

    def __init__(self, header: dict[str, Any], requests: pa.Table) -> None:
        self.vocab = header["engine"].vocab_size
        self.block = (header.get("prompt_blocks") or {}).get("block_tokens")
        self.n_prompt = requests["num_prompt_tokens"].to_numpy()
        self.ids = Column(requests, "id")
        self._tokens = _list_column(requests, "prompt_tokens")
        self._blocks = _list_column(requests, "prompt_block_ids")
        self._outputs = _list_column(requests, "output_tokens")

    def prompt(self, row: int) -> np.ndarray:
        col = self._tokens
        if col is not None and col[2][row]:
            off, vals, _ = col
            return np.asarray(vals[off[row]:off[row + 1]], dtype=np.int64)
        off, vals, _ = self._blocks  # validated: one of the two is present
        return block_tokens(vals[off[row]:off[row + 1]], self.block, int(self.n_prompt[row]),
                            self.vocab)

    def prompt_blocks(self, row: int) -> tuple[list[int], int] | None:
        """(trace block ids, tokens per block) of a prompt synthesised from block
        ids; None where the row stores its tokens. Equal ids at equal positions
        are equal tokens, which lets an engine reuse a prefix's block hashes."""
        col = self._tokens
        if (col is not None and col[2][row]) or self._blocks is None or not self.block:
            return None
        off, vals, _ = self._blocks
        return vals[off[row]:off[row + 1]].tolist(), int(self.block)

    def output(self, row: int, output_len: int, extra: int) -> np.ndarray:
        """The tokens the null model emits, plus ``extra`` for late drafts."""
        col = self._outputs
        synth = stream_tokens(f"out:{self.ids[row]}", 0, output_len + extra, self.vocab)
        if col is not None and col[2][row]:
            off, vals, _ = col
            synth[:output_len] = vals[off[row]:off[row + 1]]
        return synth


def request_rows(requests: pa.Table) -> RequestRows:
    """Absent optional columns read as None in every row."""
    return RequestRows(*(Column(requests, name) for name in (
        "id", "arrival_step", "after", "num_prompt_tokens", "output_len", "cache_salt",
        "lora_name", "priority")))
