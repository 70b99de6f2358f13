#!/usr/bin/env bash
# System packages the Mooncake client needs on a CPU machine (Debian/Ubuntu):
# libibverbs1, even when only TCP is used. Installs it when missing and we are root.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "scripts/system-deps.sh: libibverbs1 is missing; run: sudo apt-get install -y libibverbs1" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q libibverbs1 >/dev/null
