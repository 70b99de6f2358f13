"""Every engine setting under each release's own name, refused where a release lacks it.

The table in docs/engines.md is the adapters' mapping with each release's
defaults (read from its fetched ``vllm/config/*.py``); every name it maps must
be a field of that release, every setting it calls lacking must truly be
absent. A trace that sets a lacking setting is refused (exit 2) unless
``--allow-missing`` names it, and ``--set`` is checked as the file is: the
same key refused the same way both ways.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SCENARIOS, cli, cli_here
from replayer.replay.engines.config.engine_config import SETTINGS, Env, Lacking, Named
from replayer.replay.engines.settings_table import (
    config_fields,
    env_defaults,
    release_mapping,
    table,
)
from replayer.replay.engines.sources.releases import KNOWN_RELEASES, release_sources

JUNCTION = SCENARIOS / "shared_system_prompt_hybrid.yaml"
PAIR = SCENARIOS / "vllm51295_turn1_24577.yaml"
DOCS = REPO / "docs" / "engines.md"


def test_the_docs_table_is_the_one_the_adapters_give():
    text = DOCS.read_text()
    shown = re.search(r"<!-- settings-table: begin -->\n(.*?)<!-- settings-table: end -->",
                      text, re.S)
    assert shown is not None, "docs/engines.md lost its settings table markers"
    assert shown.group(1) == table(), ("docs/engines.md's settings table is stale: paste "
                                       "python -m replayer.replay.engines.settings_table")


@pytest.mark.parametrize("version", KNOWN_RELEASES)
def test_every_name_is_that_releases_and_every_lacking_one_is_absent(version):
    fields = config_fields(release_sources(version))
    mapping = release_mapping(version)
    assert set(mapping) == set(SETTINGS)
    for key, entry in mapping.items():
        if isinstance(entry, Named):
            assert entry.name in fields[entry.config], (version, key)
        elif isinstance(entry, Env):
            # read from the environment where the newest release has a config field
            newest = SETTINGS[key]
            assert isinstance(newest, Named)
            assert entry.name in env_defaults(release_sources(version)), (version, key)
            assert newest.name not in fields[newest.config], (version, key)
        else:
            newest = SETTINGS[key]
            assert isinstance(entry, Lacking) and isinstance(newest, Named)
            assert newest.name not in fields[newest.config], (version, key)


def test_0_30_spells_the_shared_prefix_checkpoint_its_own_way():
    """The name the 0.30 adapter passes is 0.30's field of the same docstring as 0.31's."""
    def doc(version: str, name: str) -> str:
        text = (release_sources(version) / "config" / "cache.py").read_text()
        return text.split(f"    {name}: bool = False\n", 1)[1].split('"""')[1]

    entry = release_mapping("0.30.0")["enable_mamba_shared_prefix_checkpoint"]
    assert entry == Named("CacheConfig", "enable_mamba_fine_grained_prefix_cache")
    assert doc("0.30.0", entry.name) == doc("0.31.0", "enable_mamba_shared_prefix_checkpoint")


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


@pytest.mark.parametrize("given,inside", [
    ({"prefix_cache_retention_interval": 0}, "0"),
    ({"prefix_cache_retention_interval": 4096}, "4096"),
    ({"prefix_cache_retention_interval": None}, None),     # dense: unset, as 0.28 reads it
    ({}, None),                                            # left out: the release's default
])
def test_0_28_reads_the_traces_retention_from_its_environment_while_it_builds(
        monkeypatch, given, inside):
    """0.26-0.28 read the interval from VLLM_PREFIX_CACHE_RETENTION_INTERVAL: the trace's
    value is there while the engine is built, never the caller's, which comes back after."""
    import os

    from replayer.replay.engines import vllm_0_29
    from traces.model.engine_spec import EngineBlock

    monkeypatch.setenv(RETENTION_ENV, "1536")
    engine = EngineBlock.from_dict("engine", {"block_size": 16, **given})
    assert vllm_0_29.release_settings("0.28.0")["prefix_cache_retention_interval"] == Env(
        RETENTION_ENV)
    with vllm_0_29._release_environment(engine, "0.28.0"):
        assert os.environ.get(RETENTION_ENV) == inside
    assert os.environ[RETENTION_ENV] == "1536"
    with vllm_0_29._release_environment(engine, "0.29.0"):     # a config field there
        assert os.environ[RETENTION_ENV] == "1536"


def _with_engine(tmp_path: Path, source: Path, **engine) -> Path:
    """``source`` with keys added to its engine block, as a scenario file."""
    raw = yaml.safe_load(source.read_text())
    raw["engine"].update(engine)
    out = tmp_path / source.name
    out.write_text(yaml.safe_dump(raw))
    return out


def _message(stderr: str) -> str:
    """The error line less the part naming where it came from (file, or file and --set)."""
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("replayer: error: "), stderr
    return re.sub(r"^replayer: error: .*?(?: under --set \S+)?: ", "", line)


@pytest.mark.parametrize("key,value", [
    ("async_scheduling", True),              # the file's sanity check, not the engine block's
    ("max_model_len", 1000),                 # shorter than a prompt: the requests' check
])
def test_set_refuses_what_the_file_refuses(tmp_path, key, value):
    in_file = cli_here("run", _with_engine(tmp_path, PAIR, **{key: value}))
    on_line = cli_here("run", PAIR, "--set", f"engine.{key}={json.dumps(value)}")
    assert in_file.returncode == on_line.returncode == 2, (in_file.stderr, on_line.stderr)
    assert _message(in_file.stderr) == _message(on_line.stderr)
    assert "under --set" in on_line.stderr


def test_allow_missing_names_a_setting():
    res = cli_here("run", PAIR, "--allow-missing", "no_such_key")
    assert res.returncode == 2
    assert "--allow-missing no_such_key: not an engine setting" in res.stderr


@pytest.mark.slow
def test_a_release_lacking_a_set_setting_refuses_it_both_ways(tmp_path):
    """0.29 has no shared-prefix checkpoint flag: the file and --set give the same
    one-line refusal, exit 2; --allow-missing replays and the JSON says it dropped it.
    The file's refusal is the adapter's check on the loaded file, here in this
    process (the call the adapter makes, on the table it reads): a third vLLM 0.29
    process for the same line proved nothing the other two do not."""
    from replayer.cli.common import load_with_sets
    from replayer.replay.engines import UnsupportedByEngine, vllm_0_29
    from replayer.replay.engines.config.engine_config import refuse_dropped

    in_file = load_with_sets(_with_engine(tmp_path, JUNCTION,
                                          enable_mamba_shared_prefix_checkpoint=True), [])
    with pytest.raises(UnsupportedByEngine) as refused:
        refuse_dropped(in_file.engine, vllm_0_29.release_settings("0.29.0"), "0.29.0")
    on_line = cli("run", JUNCTION, "--engine", "vllm==0.29.0",
                  "--set", "engine.enable_mamba_shared_prefix_checkpoint=true")
    assert on_line.returncode == 2, on_line.stderr
    assert on_line.stderr.strip().splitlines()[-1] == f"replayer: error: {refused.value}"
    assert "--allow-missing enable_mamba_shared_prefix_checkpoint" in on_line.stderr
    out = tmp_path / "out.json"
    allowed = cli("run", JUNCTION, "--engine", "vllm==0.29.0",
                  "--set", "engine.enable_mamba_shared_prefix_checkpoint=true",
                  "--allow-missing", "enable_mamba_shared_prefix_checkpoint", "--json", out)
    assert allowed.returncode == 0, allowed.stderr
    engine = json.loads(out.read_text())["engine"]
    assert engine["dropped"] == ["enable_mamba_shared_prefix_checkpoint"]
    assert "has no engine.enable_mamba_shared_prefix_checkpoint" in allowed.stderr


@pytest.mark.slow
def test_0_30_replays_the_flag_under_its_old_name(tmp_path):
    """Before, 0.30 replayed without it (3072 on user_c, the fixture's golden); under
    its own name it hits 4480 there, as 0.31 does with the flag."""
    out = tmp_path / "out.json"
    res = cli("run", JUNCTION, "--engine", "vllm==0.30.0", "--json", out,
              "--set", "engine.enable_mamba_shared_prefix_checkpoint=true")
    assert res.returncode == 0, res.stderr
    hits = {r["id"]: r["num_cached_tokens"] for r in json.loads(out.read_text())["requests"]}
    assert hits["user_c"] == 4480
    assert "dropped" not in json.loads(out.read_text())["engine"]
