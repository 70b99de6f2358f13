#!/usr/bin/env bash
# The test suite, as CI runs it. Tests that start a real mooncake_master or a
# real vllm serve (live_server) run inside a private network namespace when we
# can make one (root + unshare), so nothing they start listens beyond this
# machine's test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pytest -q -m "not real_master and not live_server" "$@"
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null; then
  echo "real-master and live-server tests in a private network namespace:"
  unshare -n sh -c "ip link set lo up && exec '$PY' -m pytest -q -m 'real_master or live_server' $*"
else
  "$PY" -m pytest -q -m "real_master or live_server" "$@"
fi
