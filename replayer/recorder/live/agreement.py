"""Three answers per request, which must be equal.

For each request of a live recording: (a) the cached tokens the server told
the client (``client.parquet``), (b) the recorder's outcome (the scheduler's
``prefill_stats``, ``outcomes`` table), (c) the CPU replay of the recorded
trace on an engine (``replayer run --engine ... --json``, a child process, as
a user runs it). Every difference is reported for its request, with what each
KV-cache group alone could have hit where the engine says it, never averaged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from traces.model.gaps import explain_gap, explain_groups
from replayer.recorder.live.client import read_client
from traces.model.outcome import RequestOutcome
from traces.trace import read_trace

# vLLM's engine id of a completion: cmpl-<request_id>-<choice>-<random suffix>
_ENGINE_ID = re.compile(r"^cmpl-(?P<name>.+)-\d+-[0-9a-f]+$")


def client_name(engine_id: str) -> str:
    m = _ENGINE_ID.match(engine_id)
    return m.group("name") if m else engine_id


@dataclass
class Agreement:
    engine: str
    requests: int = 0
    agreeing: int = 0
    lines: list[str] = field(default_factory=list)     # one per difference

    @property
    def ok(self) -> bool:
        return self.requests > 0 and self.agreeing == self.requests and not self.lines

    def summary(self) -> str:
        return (f"three-way agreement (client, recorder, replay on {self.engine}): "
                f"{self.agreeing}/{self.requests} request(s) agree")


def replay_json(trace_dir: Path, engine: str) -> dict:
    """``replayer run TRACE --engine ENGINE --json``, in a child process."""
    with tempfile.TemporaryDirectory(prefix="replayer-live-") as tmp:
        out = Path(tmp) / "replay.json"
        cmd = [sys.executable, "-m", "replayer", "run", str(trace_dir), "--json", str(out)]
        if engine != "installed":
            cmd += ["--engine", engine]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"replay of {trace_dir} on {engine} failed: "
                               f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        return json.loads(out.read_text())


def agree(trace_dir: Path, engine: str = "vllm==0.32.0") -> Agreement:
    trace_dir = Path(trace_dir)
    trace = read_trace(trace_dir)
    client = read_client(trace_dir)
    recorded = {r["id"]: r for r in trace.outcomes.to_pylist()} if trace.outcomes else {}
    replay = replay_json(trace_dir, engine)
    replayed = {r["id"]: RequestOutcome(**r) for r in replay["requests"]}
    groups = replay.get("kv_groups")
    result = Agreement(engine=engine)
    names = {client_name(rid): rid for rid in trace.requests.column("id").to_pylist()}
    for name in sorted(set(names) | set(client)):
        result.requests += 1
        rid = names.get(name)
        c = client.get(name, {}).get("cached_tokens")
        o = recorded.get(rid, {}).get("num_cached_tokens") if rid else None
        r = replayed[rid].num_cached_tokens if rid in replayed else None
        if c is not None and c == o == r:
            result.agreeing += 1
            continue
        line = f"{name} ({rid or 'not in the trace'}): client {c}, recorder {o}, replay {r}"
        if isinstance(o, int) and isinstance(r, int) and o != r:
            line += f"; replay {explain_gap(o, r, trace.engine)}"
        why = explain_groups(replayed.get(rid), groups)
        if why:
            line += f"; {why}"
        result.lines.append(line)
    return result
