"""Which recorder adapter serves which vLLM release: one module per release range.

The hooks themselves (:mod:`.scheduler`, :mod:`.connector`, :mod:`.header`)
are shared; what a release range does differently lives in its adapter
module (``vllm_0_32``, ``vllm_0_33``), found here by release prefix. A vLLM
no adapter serves is refused in one line when the server starts: a server
that fails to start says why; a recording that is quietly wrong does not.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RECORD_ENV = "PREFIX_REPLAYER_RECORD_DIR"

# release prefix -> recorder adapter module
RECORDER_ADAPTERS: dict[str, str] = {
    "0.32": "replayer.recorder.vllm_0_32",
    "0.33": "replayer.recorder.vllm_0_33",
}
RECORDER_RELEASES = tuple(RECORDER_ADAPTERS)


def _prefix(version: str) -> str | None:
    for r in RECORDER_ADAPTERS:
        if version == r or version.startswith(r + "."):
            return r
    return None


def check_release(version: str, connector: bool = False) -> ModuleType:
    """The adapter for ``version``; RuntimeError (one line) when none serves it,
    or, with ``connector``, when its adapter does not record the store."""
    prefix = _prefix(version)
    if prefix is None:
        raise RuntimeError(
            f"prefix-replayer recorder: vLLM {version} is not supported (it hooks "
            f"{', '.join(r + '.x' for r in RECORDER_RELEASES)}); unset {RECORD_ENV} "
            "(and recorder_dir) to serve without recording")
    module = importlib.import_module(RECORDER_ADAPTERS[prefix])
    if connector and not module.RECORDS_CONNECTOR:
        with_store = [r + ".x" for r in RECORDER_RELEASES
                      if importlib.import_module(RECORDER_ADAPTERS[r]).RECORDS_CONNECTOR]
        raise RuntimeError(
            f"prefix-replayer recorder: the KV connector is not recorded on vLLM {version} "
            f"(only on {', '.join(with_store)}); unset {RECORD_ENV} (and recorder_dir) "
            "to serve without recording")
    return module
