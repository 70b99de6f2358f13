"""One target's golden check, as text and an exit code: the CLI prints it, the
pytest plugin (:mod:`replayer.pytest_plugin`) shows it as a failure, so both
say exactly the same thing (first divergence, per-group why line, store keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.goldens import compare, select

EXIT_OK, EXIT_MISMATCH = 0, 1


@dataclass(frozen=True)
class CheckOutcome:
    lines: list[str]
    code: int                   # EXIT_OK, or EXIT_MISMATCH (mismatch, no goldens, rewritten)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def golden_key(spec: Any) -> str:
    """The key an engine's goldens are filed under (``vllm==X.Y.Z``), from a parsed
    spec (:func:`replayer.engines.specs.parse_spec`): known before it runs or is fetched."""
    from .engines import installed_vllm_version

    version = installed_vllm_version() if spec.version is None else spec.version
    return f"vllm=={version}"


def has_goldens(trace: Any, key: str) -> bool:
    return select(trace.goldens, key) is not None


def said_before_replay(spec: Any, trace: Any) -> bool:
    """Whether "no goldens" may be said of ``trace`` before any replay: not when the
    engine will refuse it anyway (connector replay on a release or tree, refused by
    :class:`replayer.engine_process.EngineProcess`, which ``check`` reports as SKIP)."""
    return spec.kind == "installed" or not trace.engine.connector


def no_goldens(path: Path | str, key: str) -> CheckOutcome:
    """What ``check`` says, without replaying, of a target with no goldens for ``key``."""
    return CheckOutcome([f"FAIL {path}: no goldens for engine {key} (record them with "
                         "--update-golden); not replayed"], EXIT_MISMATCH)


def check_result(path: Path, trace: Any, result: Any, update_golden: bool = False) -> CheckOutcome:
    """Compare one replay with its goldens, or rewrite them (``update_golden``)."""
    from traces.scenario import is_scenario_path

    from . import store_check
    from .golden_update import update
    from .report import check_report

    engine_key = result.engine.key
    chosen = select(trace.goldens, engine_key)
    if update_golden:
        golden_key_ = chosen[0] if chosen else engine_key
        written, where = update(path, is_scenario_path(path), trace.goldens, golden_key_,
                                engine_key, result.requests)
        label = "any engine" if written == "*" else written
        lines = [f"UPDATED {path}: goldens for {label} rewritten in {where} from engine "
                 f"{engine_key}; review the change before committing"]
        store_where = store_check.update(path, is_scenario_path(path), trace, result)
        if store_where:
            lines.append(f"UPDATED {path}: store goldens rewritten in {store_where}")
        return CheckOutcome(lines, EXIT_MISMATCH)
    if chosen is None:
        return no_goldens(path, engine_key)
    golden_key_, expect = chosen
    mismatches = compare(expect, result.requests)
    store_lines, store_ok = store_check.check(trace, result)
    report = check_report(str(path), engine_key, golden_key_, mismatches, result,
                          trace.engine, len(expect))
    if not store_ok and not mismatches:
        report = "FAIL" + report[len("PASS"):] + ", but the store does not"
    return CheckOutcome([report, *store_lines],
                        EXIT_MISMATCH if mismatches or not store_ok else EXIT_OK)
