"""Rewriting a scenario's golden blocks in place, with ruamel.yaml's round trip.

``--update-golden`` changes only the ``expect:`` and ``expect_store:`` blocks:
ruamel.yaml loads the whole file as a document that remembers its comments,
quoting, flow and block styles, the blocks are updated in that document (an
entry's comment stays with it), and the document is written back. The
scenario reader is PyYAML (YAML 1.1), so a request id whose plain spelling
PyYAML would read as something else (``yes``, ``null``, ``0x10``, ``#c``)
is written quoted. The new file is read back with the scenario reader before
it replaces the old one, through the one atomic writer (mode kept, symlinks
followed): a rewrite that would not load again writes nothing.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.scalarstring import DoubleQuotedScalarString
from ruamel.yaml.util import load_yaml_guess_indent

from traces.io.atomic import write_atomic
from traces.model.errors import TraceError


def _plain_reads_back(text: str) -> bool:
    """Whether PyYAML reads ``text`` written plain as a mapping key as that string."""
    try:
        return yaml.safe_load(f"{text}: 0\n") == {text: 0}
    except yaml.YAMLError:
        return False


def _key(value: Any) -> Any:
    if isinstance(value, str) and not _plain_reads_back(value):
        return DoubleQuotedScalarString(value)
    return value


def _flow(value: Any) -> Any:
    """A new value in the styles goldens are written in: mappings and lists in flow."""
    if isinstance(value, dict):
        out = CommentedMap((_key(k), _flow(v)) for k, v in value.items())
        out.fa.set_flow_style()
        return out
    if isinstance(value, list):
        seq = CommentedSeq(value)
        seq.fa.set_flow_style()
        return seq
    return value


def _new(value: Any, depth: int) -> Any:
    """A new entry: ``depth`` mapping levels in block style, flow style below."""
    if depth > 0 and isinstance(value, dict):
        out = CommentedMap()
        for k, v in value.items():
            out[_key(k)] = _new(v, depth - 1)
        return out
    return _flow(value)


def _replace(old: Any, value: Any) -> Any:
    """A leaf value replaced, in the old one's flow or block style."""
    new = _flow(value)
    if (isinstance(old, (CommentedMap, CommentedSeq)) and type(new) is type(old)
            and not old.fa.flow_style()):
        new.fa.set_block_style()
    return new


def _sync(node: Any, seen: Any, new: Any, depth: int) -> Any:
    """``node`` (ruamel's) updated in place to hold ``new``, ``depth`` mapping
    levels entry by entry; below that, values are replaced.

    ``seen`` is the same mapping as PyYAML read it, in the same order, so each
    of ``node``'s keys is matched by what the scenario reader made of it
    (``str(key)``). Entries kept keep their place and their comments; new ones
    go at the end."""
    if depth == 0:
        return _replace(node, new)
    if not (isinstance(node, CommentedMap) and isinstance(seen, dict) and isinstance(new, dict)):
        return _new(new, depth)
    if len(node) != len(seen):
        raise ValueError("a key appears twice")
    by_name = {str(k): (rk, seen[k]) for rk, k in zip(list(node), seen)}
    for name, (rk, _) in by_name.items():
        if name not in new:
            del node[rk]
    for name, value in new.items():
        if name in by_name:
            rk, seen_value = by_name[name]
            node[rk] = _sync(node[rk], seen_value, value, depth - 1)
        else:
            node[_key(name)] = _new(value, depth - 1)
    return node


def rewrite_blocks(path: str | Path, blocks: dict[str, tuple[dict[str, Any], int]],
                   check: Callable[[Path], None]) -> Path:
    """Replace top-level blocks of the scenario at ``path``: ``{name: (new content,
    depth)}``, where ``depth`` is how many mapping levels are synced entry by
    entry (the rest is written in flow style). ``check(tmp)`` reads the new file
    back and raises to abandon it. Returns the file written (a link's target)."""
    path = Path(path)
    try:
        text = path.read_text()
        seen = yaml.safe_load(text)
        _, indent, offset = load_yaml_guess_indent(text)
        rt = YAML(typ="rt")
        rt.preserve_quotes = True
        rt.width = 1 << 16                          # never fold a line that was not folded
        rt.brace_single_entry_mapping_in_flow_sequence = True
        rt.indent(mapping=2, sequence=indent or 2, offset=offset or 0)
        doc = rt.load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, YAMLError) as exc:
        raise TraceError(path, f"cannot rewrite its goldens: {_first_line(exc)}") from None
    if not isinstance(doc, CommentedMap) or not isinstance(seen, dict):
        raise TraceError(path, "cannot rewrite its goldens: not a YAML mapping")
    for name, (content, depth) in blocks.items():
        try:
            if name in doc:
                doc[name] = _sync(doc[name], seen.get(name), content, depth)
            else:
                doc[name] = _new(content, depth)
        except ValueError as exc:
            raise TraceError(path, f"cannot rewrite {name}: {exc}") from None
    out = io.StringIO()
    rt.dump(doc, out)
    return write_atomic(path, out.getvalue(), check=check)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
