"""What every segment process imports, imported once by the pool's fork server.

The pool's processes fork from a server that imported this module (vLLM's
engine core through the installed release's adapter, its state digest, the
replay loop), so a segment's start-up is its engine's build alone: on two
cores, two spawned interpreters importing vLLM side by side took ~21 s each,
one import shared by both about half that (docs/benchmarks.md#time-segments).
"""

from __future__ import annotations

import importlib
import os

from replayer.replay.engines import adapter_module_for, installed_vllm_version
from replayer.replay.execution import in_process  # noqa: F401 - the replay loop
from replayer.replay.segments.hosts import HEAD_ENV, exit_when_gone
from replayer.replay.segments.worker import digest_module

_version = installed_vllm_version()
importlib.import_module(adapter_module_for(_version))
if digest_module(_version) is not None:
    importlib.import_module(digest_module(_version))

# In the fork server (started by the head, which it names): end with the head.
if os.environ.get(HEAD_ENV) == str(os.getppid()):
    exit_when_gone(os.getppid())
