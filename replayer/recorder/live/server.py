"""Starting and stopping ``vllm serve`` from ``.venv-serve`` with the recorder on.

The server and its client must share a network namespace that reaches
nothing else (``unshare -n`` with ``lo`` up, as scripts/run-tests.sh does):
vLLM opens internal ZMQ ports besides the HTTP one. ``--shutdown-timeout``
makes SIGINT drain the engine instead of killing its process at once, so the
recorder's last rows are flushed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from replayer import SOURCE_ROOT
from replayer.recorder.live.configs import ServeConfig

ROOT = SOURCE_ROOT
SERVE_VENV = ROOT / ".venv-serve"
SERVED_NAME = "tiny"
LOG_TAIL = 15


class LiveError(RuntimeError):
    """The server could not be started or stopped; the message is one line plus the log tail."""


# vLLM's KV-cache events on, to its null publisher: the recorder records every
# batch the scheduler publishes (``--kv-events`` of tools/record_live.py).
KV_EVENTS_ARGS = ("--kv-events-config",
                  json.dumps({"enable_kv_cache_events": True, "publisher": "null"}))


def serve_command(cfg: ServeConfig, port: int, venv: Path = SERVE_VENV,
                  kv_events: bool = False, record: bool = True,
                  tokenizer: Path | None = None) -> list[str]:
    """``record``: the recording scheduler (else vLLM's own); ``tokenizer``: a text
    tokenizer's directory (:mod:`.tokenizer`; else token-id prompts only)."""
    extra = KV_EVENTS_ARGS if kv_events else ()
    sched = ("--scheduler-cls", "replayer.recorder.scheduler.RecordingScheduler") \
        if record else ()
    text = ("--tokenizer", str(tokenizer)) if tokenizer else ("--skip-tokenizer-init",)
    return [str(venv / "bin" / "vllm"), "serve", str(cfg.model),
            "--served-model-name", SERVED_NAME, "--load-format", "dummy",
            *text, "--dtype", "bfloat16", "--enforce-eager",
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--no-async-scheduling", *sched,
            "--max-model-len", str(cfg.max_model_len), "--seed", "0",
            "--shutdown-timeout", "60", *cfg.serve_args, *extra]


def serve_env(out: Path | None, flush_seconds: float | None = None) -> dict[str, str]:
    """The server's environment: the recorder on when ``out`` is given, found as a
    user's server finds it (the package pip installed into .venv-serve, not a
    PYTHONPATH), logging at vLLM's default level (the recorder says where it
    records there)."""
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("PYTHONPATH", None)
    env.pop("PREFIX_REPLAYER_RECORD_DIR", None)
    if out is not None:
        env["PREFIX_REPLAYER_RECORD_DIR"] = str(out)
    if flush_seconds is not None:
        env["PREFIX_REPLAYER_RECORD_FLUSH_SECONDS"] = str(flush_seconds)
    return env


def log_tail(log: Path, n: int = LOG_TAIL) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("  | " + ln for ln in lines[-n:])


@dataclass
class Server:
    cfg: ServeConfig
    out: Path
    log: Path
    port: int
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    kv_events: bool = False          # publish (and so record) vLLM's KV-cache events
    record: bool = True              # False: vLLM's own scheduler, nothing recorded
    tokenizer: Path | None = None    # a text tokenizer (text clients, `vllm bench serve`)
    flush_seconds: float | None = None   # the recorder's flush interval (its default: None)
    extra_args: tuple[str, ...] = ()     # more `vllm serve` arguments (a KV connector)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 600.0, venv: Path = SERVE_VENV) -> None:
        vllm = venv / "bin" / "vllm"
        if not vllm.exists():
            raise LiveError(f"{vllm} does not exist: build it with `make serve-venv`")
        t0 = time.monotonic()
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(serve_command(self.cfg, self.port, venv,
                                                       self.kv_events, self.record,
                                                       self.tokenizer) + list(self.extra_args),
                                         env={**serve_env(self.out if self.record else None,
                                                          self.flush_seconds), **self.extra_env},
                                         stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise LiveError(f"vllm serve ({self.cfg.name}) exited with code "
                                f"{self.proc.returncode} before it was ready; log {self.log}:\n"
                                + log_tail(self.log))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    self.startup_s = time.monotonic() - t0
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        self.kill()
        raise LiveError(f"vllm serve ({self.cfg.name}) not ready after {timeout:.0f} s; "
                        f"log {self.log}:\n" + log_tail(self.log))

    def prefix_metrics(self) -> dict[str, float]:
        """vLLM's own ``/metrics`` prefix-cache counters, in tokens, counted once per
        request at admission: a witness of the hits no part of this project computes."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        got = {}
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            values = re.findall(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            got[name] = sum(float(v) for v in values)
        return got

    def stop(self, timeout: float = 120.0) -> int:
        """SIGINT, as an operator stops it: the engine drains and the recorder flushes."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LiveError(f"vllm serve ({self.cfg.name}) did not stop {timeout:.0f} s after "
                            f"SIGINT; killed. log {self.log}:\n" + log_tail(self.log)) from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
