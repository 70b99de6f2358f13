"""Helpers for the engine tests: the CLI with an environment, vLLM source trees, git repos."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from conftest import REPO, SCENARIOS, cli  # noqa: F401 - shared with the tests

# The EAGLE drop in vLLM 0.33's full-attention lookup: with a prefix-match unit
# finer than the block it drops one unit. The patch drops a whole block instead,
# which is what 0.29 effectively did: the #51295 turn 2 then hits 23040, not 24448.
DROP_FILE = Path("v1") / "core" / "single_type_kv_cache_manager.py"
DROP_LINE = "            hit_length -= min(alignment_tokens, block_size)\n"
PATCHED_LINE = "            hit_length -= block_size\n"

SOURCE_SUFFIXES = (".py", ".pyi", ".json", ".jinja", ".typed")


def installed_vllm_package() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def copy_vllm_sources(dest: Path, *, bytecode: bool) -> Path:
    """A copy of the installed ``vllm`` package's Python sources (no kernels).

    ``bytecode`` keeps ``__pycache__`` (mtimes are copied too, so it stays valid
    and the copy imports as fast as the installed package).
    """
    def ignore(folder: str, names: list[str]) -> list[str]:
        out = []
        for n in names:
            if os.path.isdir(os.path.join(folder, n)):
                if n == "__pycache__" and not bytecode:
                    out.append(n)
            elif not n.endswith(SOURCE_SUFFIXES + ((".pyc",) if bytecode else ())):
                out.append(n)
        return out

    shutil.copytree(installed_vllm_package(), dest, ignore=ignore)
    return dest


def patch_eagle_drop(package: Path) -> None:
    """Edit the one line of the EAGLE drop (fails loudly if vLLM moved it)."""
    path = package / DROP_FILE
    text = path.read_text()
    assert text.count(DROP_LINE) == 1, f"the EAGLE drop line is not in {path} exactly once"
    path.write_text(text.replace(DROP_LINE, PATCHED_LINE))


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    proc = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def init_repo(repo: Path) -> None:
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text("__pycache__/\n")


# vLLM #56794 ("Keep transient checkpoints out of prefix-cache eviction", merged
# after #56615 was opened): under retention 0 a FlashKDA checkpoint inside a
# prompt stays request-local. 0.30.0 carries it; the deployment #56615 measured
# ran a main from before it. Removing this one rule from 0.30.0 gives #56615's
# "main" row (0 / 0 / 30464): docs/kimi-k3.md.
TRANSIENT_CHECKPOINT_RULE = """\
            if (
                retention_interval == 0
                and num_tokens < request.num_prompt_tokens
                and checkpoint_position != request.shared_prefix_boundary
            ):
                # retention_interval == 0 keeps this transient checkpoint
                # request-local. The slot may carry a hash from this step's
                # full-block pass; that must go too, since the checkpoint
                # state is about to overwrite the block.
                self.block_pool._maybe_evict_cached_block(checkpoint_block)
                return None
"""


def before_56794_tree(dest: Path) -> Path:
    """vLLM 0.30.0's sources without #56794's rule (fails loudly if it is not there)."""
    from replayer.replay.engines.sources.releases import release_sources

    shutil.copytree(release_sources("0.30.0"), dest)
    path = dest / DROP_FILE
    text = path.read_text()
    assert text.count(TRANSIENT_CHECKPOINT_RULE) == 1, (
        f"#56794's transient-checkpoint rule is not in {path} exactly once")
    path.write_text(text.replace(TRANSIENT_CHECKPOINT_RULE, ""))
    return dest
