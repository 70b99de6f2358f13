"""MooncakeStore connector replay on the releases 0.29.0-0.34.0 (vLLM #56615).

One store adapter (replayer/replay/engines/connector/mooncake_0_33.py) serves every release:
the first test reads each release's sources and fails if what its seams touch
ever differs. The others replay the store fixtures on old releases, where the
connector's own code differs: 0.30 and 0.31 write a prompt tail's attention KV
at B (the layout #56615 fixed), 0.32 at B + H. Releases come from the wheel
cache, fetched once (see tests/test_engines_replay.py).
"""

from __future__ import annotations

import ast
import inspect
import json

import pytest

from conftest import STORE_SCENARIOS, cli
from replayer.replay.engines import STORE_ADAPTERS, release_prefix
from replayer.replay.engines.sources.releases import KNOWN_RELEASES, release_sources

pytestmark = pytest.mark.slow       # each engine process costs ~10 s of vLLM imports

STORE_DIR = "distributed/kv_transfer/kv_connector/v1/mooncake/store"
# The releases a store adapter serves (0.26-0.28's lookup answers a bare hit
# count: refused, test_a_release_no_store_adapter_serves_is_refused_in_one_line).
SERVED = tuple(v for v in KNOWN_RELEASES if release_prefix(v, STORE_ADAPTERS))
JUNCTION = STORE_SCENARIOS / "shared_prefix_junction.yaml"


def _class_source(text: str, name: str) -> str:
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


# 0.34's LookupKeyClient keeps a non-blocking lookup's result for a wall-clock TTL
# and can prefetch (lookup_async, lookup_prefetch_limit: the 0.34 adapter refuses
# lookup_async); the others' is 0.33's, byte for byte.
CLIENT_AS_0_33 = ("0.29", "0.30", "0.31", "0.32", "0.33")


def _methods(text: str) -> dict[str, list[str]]:
    """A class's public methods and their parameter names."""
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.ClassDef)
    return {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in node.body
            if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


def test_what_the_store_seams_touch_is_the_same_in_every_release():
    """The lookup client the replay replaces, the server call it makes instead, the wire
    encoding, the queues it drains and the key form it parses: byte for byte, but
    0.34's client, whose every method the in-process one answers with the same
    parameters."""
    from replayer.replay.engines.connector.mooncake_session import InProcessLookupClient

    ref = release_sources("0.33.0") / STORE_DIR
    ref_worker = (ref / "worker.py").read_text()
    ref_client = _class_source(ref_worker, "LookupKeyClient")
    assert "def lookup(" in ref_client and "def reset(" in ref_client
    ours = _methods(inspect.getsource(InProcessLookupClient))
    for version in SERVED:
        src = release_sources(version) / STORE_DIR
        worker = (src / "worker.py").read_text()
        client = _class_source(worker, "LookupKeyClient")
        if release_prefix(version, CLIENT_AS_0_33):
            assert client == ref_client, version
        else:
            for name, params in _methods(client).items():
                assert ours.get(name) == params, (version, name, params)
        assert (src / "protocol.py").read_text() == (ref / "protocol.py").read_text(), version
        for line in ("block_hashes = BlobBlockHashes(blob, hash_len)",
                     "result = self.store_worker.lookup(num_tokens, block_hashes)",
                     "self.recv_request_queue: queue.Queue[ReqMeta] = queue.Queue()",
                     "self.kv_send_thread = KVCacheStoreSendingThread("):
            assert line in worker, (version, line)
        keys = "".join(f.read_text() for f in (src / "data.py", src / "layout.py")
                       if f.exists())                    # layout.py: 0.34's
        assert 'f"@group:{key_metadata.group_id}"' in keys, version


def test_0_34s_runner_step_sets_what_active_kv_connector_init_sets():
    """connector_step on 0.34 builds vLLM's ActiveKVConnector without its __init__
    (which would register the KV caches again): the attributes it sets by hand
    must be every one that __init__ sets."""
    source = (release_sources("0.34.0") / "v1" / "worker" / "gpu" / "kv_connector.py").read_text()
    init = next(f for f in ast.walk(ast.parse(_class_source(source, "ActiveKVConnector")))
                if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute)}
    assert assigned == {"vllm_config", "kv_connector", "_pending_load_kwargs", "_disabled"}


def test_a_release_no_store_adapter_serves_is_refused_in_one_line():
    """0.26-0.28's lookup client returns a bare hit count (0.29 on: a lookup result
    with tail-key boundaries), so the store adapter's seam does not fit: refused
    before any replay, naming the release."""
    for version in (v for v in KNOWN_RELEASES if v not in SERVED):
        worker = (release_sources(version) / STORE_DIR / "worker.py").read_text()
        assert "return int.from_bytes(resp, \"big\")" in _class_source(
            worker, "LookupKeyClient"), version
    proc = cli("run", JUNCTION, "--engine", "vllm==0.28.0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "replayer: error: vllm 0.28.0 (release): connector replay (mooncake_store) is not "
        "supported on vLLM 0.28.0 yet (its MooncakeStore API differs; replayed on 0.29.x, "
        "0.30.x, 0.31.x, 0.32.x, 0.33.x, 0.34.x)"]


def test_diff_names_the_keys_that_moved_when_the_outcomes_agree(tmp_path):
    """shared_prefix_junction misses on 0.31.0 and 0.32.0 alike, but the prompt tails'
    attention KV moved from B (0.31) to B + H (0.32): diff says so, and exits 1."""
    out = tmp_path / "diff.json"
    proc = cli("diff", JUNCTION, "--engine", "vllm==0.31.0", "--engine", "vllm==0.32.0",
               "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "A: vllm 0.31.0 (release)",
        "B: vllm 0.32.0 (release)",
        "identical: 2 requests, the same outcome on A and B",
        "store: 2 key(s) only on A, 2 only on B, 0 lookup(s) differ",
        "  only on A: group 0 @ 8320 (user_b)",
        "  only on A: group 0 @ 8832 (user_a)",
        "  only on B: group 0 @ 8448 (user_b)",
        "  only on B: group 0 @ 8960 (user_a)"]
    data = json.loads(out.read_text())
    assert data["identical"] is False and data["requests"] == []
    assert data["store"] == {
        "identical": False, "lookups": [],
        "only_a": [{"request": "user_b", "group": 0, "boundary": 8320},
                   {"request": "user_a", "group": 0, "boundary": 8832}],
        "only_b": [{"request": "user_b", "group": 0, "boundary": 8448},
                   {"request": "user_a", "group": 0, "boundary": 8960}]}


def test_old_releases_check_the_store_fixtures_against_their_own_goldens():
    # The whole folder on 0.31.0; the #56615 fixture alone on 0.30.0 (CI time).
    for version, target in (("0.31.0", "fixtures/store"),
                            ("0.30.0", "fixtures/store/resend_after_reset.yaml")):
        proc = cli("check", "--engine", f"vllm=={version}", target)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        n = len(list(STORE_SCENARIOS.glob("*.yaml"))) if target == "fixtures/store" else 1
        assert proc.stdout.count("PASS ") == n
        assert (f"PASS fixtures/store/resend_after_reset.yaml: 6 request(s) match the goldens "
                f"for vllm=={version} (engine vllm=={version})") in proc.stdout


def test_bisect_on_outcomes_finds_nothing_where_only_the_keys_moved():
    """The hits of shared_prefix_junction never change; its keys do (docs/engines.md: --on store)."""
    proc = cli("bisect", JUNCTION, "--on", "outcomes", "--good", "vllm==0.31.0",
               "--bad", "vllm==0.32.0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "bisect over 2 releases:",
        "  good  vllm 0.31.0 (release)  cached 0  keys 13  the reference",
        "  bad   vllm 0.32.0 (release)  cached 0  keys 13  matches good",
        "bad gives the same outcome as good: nothing to bisect"]
