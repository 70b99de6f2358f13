"""Bad store options and bad connector scenarios: one line, exit 2, before vLLM starts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import STORE_SCENARIOS, cli

STORE_SCENARIO = STORE_SCENARIOS / "shared_prefix_junction.yaml"


def one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replayer: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--store", "redis"], "--store 'redis': expected memory, mooncake or mooncake://HOST:PORT"),
    (["--store", "mooncake://nohost"], "--store 'mooncake://nohost': expected mooncake://HOST:PORT"),
    (["--store-capacity", "1x"], "--store-capacity '1x': expected a size such as 64MB or 2GB"),
    (["--store", "mooncake://127.0.0.1:5", "--store-capacity", "64MB"],
     "--store-capacity applies to a store the replayer starts, not to mooncake://127.0.0.1:5"),
])
def test_bad_store_options(args, needle):
    assert needle in one_line_error(cli("run", str(STORE_SCENARIO), *args))


def scenario(tmp_path: Path, engine_extra: str, tail: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(f"""\
        engine: {{block_size: 16{engine_extra}}}
        requests:
          - {{id: a, prompt: [{{stream: s, len: 40}}]}}
        """) + textwrap.dedent(tail))
    return path


@pytest.mark.parametrize("engine_extra, tail, needle", [
    (", connector: redis_store", "", "engine.connector 'redis_store' is not supported "
                                     "(known: mooncake_store, offloading)"),
    (", connector: mooncake_store, connector_config: {load_sync: true}", "",
     "unknown key 'load_sync' in engine.connector_config"),
    (", connector_config: {load_async: true}", "", "engine.connector_config needs engine.connector"),
    (", connector: mooncake_store, connector_config: {kv_role: kv_both_ways}", "",
     "engine.connector_config.kv_role must be one of kv_producer, kv_consumer, kv_both, "
     "got 'kv_both_ways'"),
    (", prefill_instance: {connector_config: {kv_role: kv_producer}}", "",
     "engine.prefill_instance needs engine.connector mooncake_store"),
    (", connector: mooncake_store, prefill_instance: {kv_role: kv_producer}", "",
     "unknown key 'kv_role' in engine.prefill_instance (known: connector_config)"),
    (", connector: mooncake_store, prefill_instance: {connector_config: {kv_role: prefill}}",
     "", "engine.prefill_instance.connector_config.kv_role must be one of kv_producer, "
         "kv_consumer, kv_both, got 'prefill'"),
    ("", "expect_store: {lookups: {a: 0}}\n", "expect_store needs engine.connector"),
    (", connector: mooncake_store", "expect_store: {lookups: {b: 0}}\n",
     "expect_store.lookups names unknown request 'b'"),
    (", connector: mooncake_store", "expect_store: {keys: {}}\n",
     "unknown key 'keys' in expect_store"),
    (", connector: mooncake_store", "expect_store: {puts: {a: {0: 1536}}}\n",
     "expect_store.puts.a.0 must be a list of boundaries"),
])
def test_bad_connector_scenarios(tmp_path, engine_extra, tail, needle):
    path = scenario(tmp_path, engine_extra, tail)
    line = one_line_error(cli("info", str(path)))
    assert str(path) in line and needle in line
