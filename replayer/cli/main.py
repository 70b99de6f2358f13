"""The ``replayer`` command line: the parser put together from each command's
module, and the one place errors become a line on stderr and an exit code.

Exit codes: 0 success, 1 a check failed (or goldens were just rewritten and
need review), 2 bad input or a replay that cannot go on (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from replayer.cli import (
    anonymize,
    bisect,
    check,
    compile,
    diff,
    explain,
    import_trace,
    info,
    report,
    run,
    server,
    shrink,
    sweep,
)
from replayer.cli.common import error
from replayer.replay.execution.environment import quiet_vllm
from traces import TraceError

# In the order `replayer --help` lists them.
COMMANDS = {"run": run, "check": check, "explain": explain, "sweep": sweep, "report": report,
            "diff": diff, "bisect": bisect, "shrink": shrink, "compile": compile,
            "import": import_trace, "server": server, "info": info, "anonymize": anonymize}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayer", description=(
        "Replay recorded request streams through vLLM's own scheduler and KV-cache "
        "manager, and check prefix-cache hits against golden results."))
    p.add_argument("--version", action=_VersionAction, nargs=0,
                   help="the replayer's version, the installed vLLM and the releases it replays")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return p


def _version_text() -> str:
    """Package metadata only: no vLLM import, so ``--version`` answers at once."""
    from importlib import metadata

    from replayer.replay.engines import EngineError, installed_vllm_version, supported_ranges

    try:
        own = metadata.version("prefix-replayer")
    except metadata.PackageNotFoundError:
        own = "(not installed)"
    try:
        vllm = f"vLLM {installed_vllm_version()} installed"
    except EngineError:
        vllm = "no vLLM installed"
    return f"replayer {own}\n{vllm}; replays vLLM releases {supported_ranges()}"


class _VersionAction(argparse.Action):
    """``--version``, printed as is (argparse's own action rewraps the lines)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version_text())
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(args_list)
    from replayer.cli import REPLAY_COMMANDS

    if args.command in REPLAY_COMMANDS and argv is None:
        from replayer.replay.execution.determinism import reexec_with_pinned_seed

        reexec_with_pinned_seed(args_list)
    quiet_vllm(getattr(args, "verbose", False))
    if getattr(args, "no_server", False):
        from replayer.replay.execution.warm.paths import NO_SERVER_ENV

        os.environ[NO_SERVER_ENV] = "1"
    from replayer.replay.engines import EngineError
    from replayer.replay.loop import ReplayError
    from replayer.replay.store import StoreError

    try:
        code = COMMANDS[args.command].run(args)
        if args.command in REPLAY_COMMANDS:
            from replayer.cli.hints import warm_server_hint
            from replayer.replay.execution.cold_starts import COLD_STARTS

            warm_server_hint(COLD_STARTS)
        return code
    except (TraceError, EngineError, ReplayError, StoreError) as exc:
        return error(str(exc))
    except OSError as exc:                  # a disk that is full, read-only, gone
        where = exc.filename or "replayer"
        return error(f"{where}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())
