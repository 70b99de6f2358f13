"""Reading a YAML file with bounds: size, nesting, alias expansion, duplicate keys.

PyYAML's safe loader builds anything the text describes: a 1 KB alias bomb
expands to a billion nodes the moment a field is printed, 100,000 nested
brackets end in a RecursionError, and a repeated key silently keeps the last
value. Here the document is composed first (nesting counted as it goes),
then its node graph is measured with aliases expanded and its mappings
checked for repeated keys, and only then turned into Python objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from traces.model.errors import TraceError
from traces.model.limits import (
    MAX_NESTING,
    MAX_YAML_BYTES,
    MAX_YAML_EXPANDED,
    decode_utf8,
    read_bounded,
)

MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """A bound was crossed while composing; carries the message."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise _Refused(f"nested deeper than {MAX_NESTING} levels at line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _measure(root: yaml.Node) -> None:
    """Values and characters after alias expansion (memoised: a bomb costs its size,
    not its expansion);
    a repeated mapping key is refused with its line."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            total = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            for child in _children(node):
                total += size[id(child)]
                if total > MAX_YAML_EXPANDED:
                    raise _Refused(f"more than {MAX_YAML_EXPANDED} values and characters once "
                                   "aliases are expanded (an alias bomb?)")
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise _Refused(f"an alias refers to itself at line {node.start_mark.line + 1}")
        if isinstance(node, yaml.MappingNode):
            _no_repeated_keys(node)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _no_repeated_keys(node: yaml.MappingNode) -> None:
    seen: set[tuple[str, str]] = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
            continue
        k = (key_node.tag, key_node.value)
        if k in seen:
            raise _Refused(f"duplicate key {key_node.value!r} at line "
                           f"{key_node.start_mark.line + 1}")
        seen.add(k)


def load_yaml_file(path: Path) -> Any:
    """The document in ``path`` as Python objects; every failure is one TraceError."""
    text = decode_utf8(path, read_bounded(path, MAX_YAML_BYTES, "YAML file"))
    loader = None
    try:
        loader = _BoundedLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node)
        return loader.construct_document(node)
    except _Refused as exc:
        raise TraceError(path, str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        if isinstance(exc, yaml.reader.ReaderError):   # no mark; its str() spans two lines
            line = f" at character {exc.position}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TraceError(path, f"invalid YAML{line}: {problem}") from None
    except RecursionError:
        raise TraceError(path, f"nested deeper than {MAX_NESTING} levels") from None
    except (ValueError, OverflowError) as exc:   # an int of 4300+ digits, a float out of range
        raise TraceError(path, f"invalid YAML value ({str(exc).splitlines()[0][:80]})") from None
    finally:
        if loader is not None:
            loader.dispose()
