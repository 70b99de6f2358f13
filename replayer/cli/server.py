"""`replayer server start|status|stop`: the warm engine server."""

from __future__ import annotations

import sys

from replayer.cli.common import error


def add_parser(sub) -> None:
    srv = sub.add_parser("server", help="a warm engine server: vLLM imported once, every "
                                        "replay a fresh fork of it (start, status, stop)")
    srv.add_argument("action", choices=["start", "status", "stop"])
    srv.add_argument("--engine", action="append", metavar="SPEC",
                     help="start: warm this engine now (repeatable; default installed; "
                          "others start on their first replay)")
    srv.add_argument("--worker", choices=("null", "model"), default=None,
                     help="start: the worker of every --engine warmed now (default null; "
                          "model: vLLM's own worker and model runner, e.g. with "
                          "--engine .venv-serve)")
    srv.add_argument("--lazy", action="store_true",
                     help="start: warm no engine now (each starts on its first replay)")
    srv.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                     help="start: stop by itself after this long unused (default 4 h)")
    srv.add_argument("--replay-timeout", type=float, default=None, metavar="SECONDS",
                     help="start: kill a replay that runs longer, and report it (default: none)")
    srv.add_argument("--replay-memory", type=int, default=None, metavar="MB",
                     help="start: kill a replay that holds more memory of its own, and "
                          "report it (default: none)")


def run(args) -> int:
    from replayer.replay.execution.warm import control

    if args.action != "start" and (args.engine or args.idle_timeout is not None or args.lazy
                                   or args.replay_timeout or args.replay_memory
                                   or args.worker):
        return error(f"server {args.action} takes no options")
    if args.action == "start":
        from replayer.replay.execution.warm.protocol import DEFAULT_IDLE_TIMEOUT_S

        idle = DEFAULT_IDLE_TIMEOUT_S if args.idle_timeout is None else args.idle_timeout
        if idle <= 0 or (args.replay_timeout is not None and args.replay_timeout <= 0) \
                or (args.replay_memory is not None and args.replay_memory <= 0):
            return error("--idle-timeout, --replay-timeout and --replay-memory must be positive")
        if args.lazy and args.engine:
            return error("server start: --lazy warms no engine; drop --engine")
        if args.lazy and args.worker:
            return error("server start: --lazy warms no engine; drop --worker")
        engines = [] if args.lazy else (args.engine or ["installed"])
        lines, code = control.start(engines, idle, args.replay_timeout,
                                    args.replay_memory, worker=args.worker or "null")
    elif args.action == "status":
        lines, code = control.status()
    else:
        lines, code = control.stop()
    for line in lines:
        print(line, file=sys.stderr if line.startswith("replayer: error") else sys.stdout)
    return code

