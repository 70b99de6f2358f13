#!/usr/bin/env bash
# Builds .venv-cpu: the replay engine with a CPU-only torch, about 3 GB on disk
# instead of the 10-11 GB of .venv (vLLM 0.33.0's CUDA torch, nvidia/, triton,
# flashinfer: none of which a replay runs). vLLM 0.33.0 pins torch 2.14.0; its
# scheduler, KV-cache manager and connector code run on the torch 2.13.0+cpu
# wheel pip's find-links offer here (every fixture checks the same as on .venv,
# measured 2026-12-03: docs/benchmarks.md). Elsewhere, name a CPU torch yourself:
#   TORCH='torch==2.13.0' TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu' \
#     scripts/install-cpu-venv.sh
# Usage: scripts/install-cpu-venv.sh [VENV_DIR]   (default .venv-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-cpu}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
VLLM=0.33.0
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install --quiet --upgrade pip
# 1. A CPU torch first, by itself, so nothing after it pulls the CUDA one.
# shellcheck disable=SC2086
"$PIP" install --quiet ${TORCH_PIP_ARGS:-} "$TORCH"
# 2. vLLM without its dependencies (they name torch 2.14.0 and the CUDA kernels' packages).
"$PIP" install --quiet --no-deps "vllm==$VLLM"
# 3. Its requirements, less the torch family and the packages only GPU kernels use
#    (markers evaluated for this interpreter).
"$VENV/bin/python" - > "$VENV/cpu-requirements.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
        "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
        "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla",
        "humming-kernels", "numba"}
for line in requires("vllm") or []:
    r = Requirement(line)
    if r.name.lower().replace("_", "-") in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    print(r)
PY
"$PIP" install --quiet -r "$VENV/cpu-requirements.txt"
# xgrammar (structured output) brings triton, about 1 GB; a replay never imports it.
"$PIP" uninstall --quiet --yes triton
# 4. This repository without the [replay] extra (which would pull the CUDA torch).
"$PIP" install --quiet -e .
"$VENV/bin/python" -c 'import torch, vllm, replayer
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not a CPU build"
print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "install-cpu-venv: pip check names the packages left out on purpose (CUDA kernels, triton)" >&2
end=$(date +%s)
echo "install-cpu-venv: $((end - start)) s, $(du -sh "$VENV" | cut -f1) on disk"
touch "$VENV/.installed"
