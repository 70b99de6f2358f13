"""MooncakeStore connector replay on the releases 0.29.0-0.33.0 (vLLM #56615).

One store adapter (replayer/engines/mooncake_0_33.py) serves every release:
the first test reads each release's sources and fails if what its seams touch
ever differs. The others replay the store fixtures on old releases, where the
connector's own code differs: 0.30 and 0.31 write a prompt tail's attention KV
at B (the layout #56615 fixed), 0.32 at B + H. Releases come from the wheel
cache, fetched once (see tests/test_engines_replay.py).
"""

from __future__ import annotations

import ast
import json

import pytest

from conftest import STORE_SCENARIOS, cli
from replayer.engines.releases import KNOWN_RELEASES, release_sources

pytestmark = pytest.mark.slow       # each engine process costs ~10 s of vLLM imports

STORE_DIR = "distributed/kv_transfer/kv_connector/v1/mooncake/store"
RESEND = STORE_SCENARIOS / "resend_after_reset.yaml"


def _class_source(text: str, name: str) -> str:
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


def test_what_the_store_seams_touch_is_the_same_in_every_release():
    """The lookup client the replay replaces, the server call it makes instead, the wire
    encoding, the queues it drains and the key form it parses: byte for byte."""
    ref = release_sources("0.33.0") / STORE_DIR
    ref_worker = (ref / "worker.py").read_text()
    ref_client = _class_source(ref_worker, "LookupKeyClient")
    assert "def lookup(" in ref_client and "def reset(" in ref_client
    for version in KNOWN_RELEASES:
        src = release_sources(version) / STORE_DIR
        worker = (src / "worker.py").read_text()
        assert _class_source(worker, "LookupKeyClient") == ref_client, version
        assert (src / "protocol.py").read_text() == (ref / "protocol.py").read_text(), version
        for line in ("block_hashes = BlobBlockHashes(blob, hash_len)",
                     "result = self.store_worker.lookup(num_tokens, block_hashes)",
                     "self.recv_request_queue: queue.Queue[ReqMeta] = queue.Queue()",
                     "self.kv_send_thread = KVCacheStoreSendingThread("):
            assert line in worker, (version, line)
        assert 'f"@group:{key_metadata.group_id}"' in (src / "data.py").read_text(), version


def test_031_writes_attention_at_b_and_diff_names_the_keys(tmp_path):
    """0.31.0 before the #56615 fix, 0.32.0 after: the hits and the keys that moved."""
    out = tmp_path / "diff.json"
    proc = cli("diff", RESEND, "--engine", "vllm==0.31.0", "--engine", "vllm==0.32.0",
               "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[:4] for line in lines[1:4]] == [
        ["p7449_again", "4608", "7296", "+2688"],
        ["p23196_again", "21504", "23040", "+1536"],
        ["p41300_again", "38400", "41088", "+2688"]]
    assert lines[lines.index("B: vllm 0.32.0 (release)") + 1:] == [
        "6 requests: 3 gained, 0 lost, 3 unchanged; tokens gained on B: +6912",
        "store: 2 key(s) only on A, 4 only on B, 3 lookup(s) differ",
        "  only on A: group 0 @ 7296 (p7449)",
        "  only on A: group 0 @ 41088 (p41300)",
        "  only on B: group 0 @ 7424 (p7449)",
        "  only on B: group 0 @ 23168 (p23196)",
        "  only on B: group 0 @ 41216 (p41300)",
        "  only on B: group 1 @ 23040 (p23196)",
        "  lookup of p7449_again: hit_length A 4608, B 7296",
        "  lookup of p23196_again: hit_length A 21504, B 23040",
        "  lookup of p41300_again: hit_length A 38400, B 41088"]
    data = json.loads(out.read_text())
    assert data["store"]["only_b"][0] == {"request": "p7449", "group": 0, "boundary": 7424}
    assert data["store"]["lookups"][0] == {"request": "p7449_again", "a": 4608, "b": 7296}


def test_old_releases_check_the_store_fixtures_against_their_own_goldens():
    for version in ("0.30.0", "0.31.0"):
        proc = cli("check", "--engine", f"vllm=={version}", STORE_SCENARIOS)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("PASS ") == len(list(STORE_SCENARIOS.glob("*.yaml")))
        assert (f"PASS fixtures/store/resend_after_reset.yaml: 6 request(s) match the goldens "
                f"for vllm=={version} (engine vllm=={version})") in proc.stdout


def test_bisect_on_store_finds_the_release_with_the_56615_fix():
    proc = cli("bisect", RESEND, "--on", "store", "--good", "vllm==0.30.0",
               "--bad", "vllm==0.33.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:5] == [
        "bisect over 4 releases:",
        "  good  vllm 0.30.0 (release)  cached 64512  keys 50  the reference",
        "  bad   vllm 0.33.0 (release)  cached 71424  keys 54  differs from good",
        "  try   vllm 0.31.0 (release)  cached 64512  keys 50  matches good",
        "  try   vllm 0.32.0 (release)  cached 71424  keys 54  differs from good"]
    assert lines[5] == "first engine that differs from good: vllm 0.32.0 (release) (4 replays)"
