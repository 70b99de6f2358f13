"""Turning a trace's requests table into the token ids an engine receives.

The one definition of a request's tokens, whichever form the trace stores:
explicit ``prompt_tokens``, or ``prompt_block_ids`` synthesised per block.
Tokens are made one request at a time, when it arrives, so a replay of the
whole conversation trace never holds 145 M tokens at once; the other columns
stay Arrow arrays read one value at a time, so a day of traffic does not
become a million Python objects either. The list columns are held whole
(:class:`WholeLists`) or, for a streamed trace, read batch by batch from the
file (:class:`traces.io.request_stream.ListWindow`): the same values either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from traces.io.request_stream import LIST_COLUMNS, RequestLists, list_arrays
from traces.model.tokens import block_tokens, stream_tokens


class WholeLists:
    """A requests table's list columns, held whole: the same reads as
    :class:`traces.io.request_stream.ListWindow` (release keeps everything)."""

    def __init__(self, table: pa.Table) -> None:
        self._cols = {name: list_arrays(table[name].combine_chunks())
                      for name in LIST_COLUMNS if name in table.column_names}

    def get(self, name: str, row: int) -> np.ndarray | None:
        col = self._cols.get(name)
        if col is None or not col[2][row]:
            return None
        off, vals, _ = col
        return vals[off[row]:off[row + 1]]

    def release(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass


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
    skip_reading_prefix_cache: Column


class TokenSource:
    """Prompt and output tokens of each request row.

    ``lists``: where the list columns are when ``requests`` lacks them (a
    streamed trace, ``Trace.request_lists``); they are then read batch by
    batch, and :meth:`release` a row once its request is built."""

    def __init__(self, header: dict[str, Any], requests: pa.Table,
                 lists: RequestLists | None = None) -> None:
        self.vocab = header["engine"].vocab_size
        self.block = (header.get("prompt_blocks") or {}).get("block_tokens")
        self.n_prompt = requests["num_prompt_tokens"].to_numpy()
        self.ids = Column(requests, "id")
        self._lists = WholeLists(requests) if lists is None else lists.window()

    def prompt(self, row: int) -> np.ndarray:
        tokens = self._lists.get("prompt_tokens", row)
        if tokens is not None:
            return np.asarray(tokens, dtype=np.int64)
        blocks = self._lists.get("prompt_block_ids", row)   # validated: one of the two is there
        return block_tokens(blocks, self.block, int(self.n_prompt[row]), self.vocab)

    def prompt_blocks(self, row: int) -> tuple[list[int], int] | None:
        """(trace block ids, tokens per block) of a prompt synthesised from block
        ids; None where the row stores its tokens. Equal ids at equal positions
        are equal tokens, which lets an engine reuse a prefix's block hashes."""
        if self._lists.get("prompt_tokens", row) is not None or not self.block:
            return None
        blocks = self._lists.get("prompt_block_ids", row)
        return None if blocks is None else (blocks.tolist(), int(self.block))

    def output(self, row: int, output_len: int, extra: int) -> np.ndarray:
        """The tokens the null model emits, plus ``extra`` for late drafts."""
        synth = stream_tokens(f"out:{self.ids[row]}", 0, output_len + extra, self.vocab)
        recorded = self._lists.get("output_tokens", row)
        if recorded is not None:
            synth[:output_len] = recorded
        return synth

    def release(self, row: int) -> None:
        """Row ``row``'s request is built: a streamed source drops its lists."""
        self._lists.release(row)

    def close(self) -> None:
        self._lists.close()


def request_rows(requests: pa.Table) -> RequestRows:
    """Absent optional columns read as None in every row."""
    return RequestRows(*(Column(requests, name) for name in (
        "id", "arrival_step", "after", "num_prompt_tokens", "output_len", "cache_salt",
        "lora_name", "priority", "skip_reading_prefix_cache")))
