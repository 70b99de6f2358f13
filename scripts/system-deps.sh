#!/usr/bin/env bash
# System packages from Debian/Ubuntu: libibverbs1 (the Mooncake client needs it on
# a CPU machine, even when only TCP is used) and chromium (the headless browser
# the report test loads the HTML page in). Installs what is missing when we are root.
set -euo pipefail
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
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
