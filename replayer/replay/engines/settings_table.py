"""Every engine setting of the scenario format, per release: its name and default.

The names come from the adapters (``release_settings`` in each adapter module,
the one place a setting is mapped to a release's own spelling); the defaults
from each release's own ``vllm/config/*.py``, read as source (``ast``, nothing
imported), so a release's table needs only its fetched sources. Printed by
``python -m replayer.replay.engines.settings_table`` and shown in
docs/engines.md, which tests/test_settings_per_release.py keeps equal to it.
"""

from __future__ import annotations

import ast
import importlib
import sys
from functools import cache
from pathlib import Path

from replayer.replay.engines import adapter_module_for
from replayer.replay.engines.config.engine_config import SETTINGS, Env, Lacking, Mapping, Named
from replayer.replay.engines.sources.releases import KNOWN_RELEASES, release_sources


def release_mapping(version: str) -> Mapping:
    """The adapter's mapping for ``version`` (its module imported, nothing built)."""
    return importlib.import_module(adapter_module_for(version)).release_settings(version)


@cache
def config_fields(package: Path) -> dict[str, dict[str, str]]:
    """Config class -> field -> its default as written, from ``package/config/*.py``."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted((package / "config").glob("*.py")):
        body = ast.parse(path.read_text()).body
        constants = {t.id: ast.unparse(st.value) for st in body if isinstance(st, ast.Assign)
                     for t in st.targets if isinstance(t, ast.Name)}
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                out.setdefault(node.name, {}).update(_fields(node, constants))
    return out


@cache
def env_defaults(package: Path) -> dict[str, str]:
    """Environment variable -> its default as ``package/envs.py`` declares it
    (the annotated names under ``if TYPE_CHECKING:``)."""
    out: dict[str, str] = {}
    for node in ast.parse((package / "envs.py").read_text()).body:
        body = node.body if isinstance(node, ast.If) else [node]
        for st in body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                out[st.target.id] = _default(st.value)
    return out


def _fields(cls: ast.ClassDef, constants: dict[str, str]) -> dict[str, str]:
    """Each annotated field's default, a module constant written as its value."""
    out = {}
    for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            text = _default(st.value)
            out[st.target.id] = out.get(text, constants.get(text, text))
    return out


def _default(value: ast.expr | None) -> str:
    """``Field(default=0, ge=0)`` -> ``0``; a factory -> ``name()``; none -> required."""
    if value is None:
        return "(required)"
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("Field", "field"):
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
            if kw.arg == "default_factory":
                return f"{ast.unparse(kw.value)}()"
        return "(required)"
    return ast.unparse(value)


def cell(entry: Named | Lacking | Env, package: Path) -> str:
    """One table cell: ``Class.name = default``, an environment variable and its
    default, or what a lacking release does."""
    if isinstance(entry, Lacking):
        return f"none: runs as `{_yaml(entry.behaves_as)}`"
    if isinstance(entry, Env):
        defaults = env_defaults(package)
        if entry.name not in defaults:
            raise LookupError(f"{package}: {entry.name} is not in its envs.py")
        return f"env `{entry.name}` = `{defaults[entry.name]}`"
    fields = config_fields(package).get(entry.config, {})
    if entry.name not in fields:
        raise LookupError(f"{package}: {entry.config}.{entry.name} is not a field there")
    return f"`{entry.config}.{entry.name}` = `{fields[entry.name]}`"


def _yaml(value: object) -> str:
    return {True: "true", False: "false"}.get(value, str(value)) if isinstance(
        value, bool) else str(value)


def table(releases: tuple[str, ...] = KNOWN_RELEASES) -> str:
    """The markdown table: one row per setting, one column per release."""
    maps = {v: release_mapping(v) for v in releases}
    packages = {v: release_sources(v) for v in releases}
    lines = ["| setting | " + " | ".join(releases) + " |",
             "|---|" + "---|" * len(releases)]
    for key in SETTINGS:
        cells = [cell(maps[v][key], packages[v]) for v in releases]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
