#!/usr/bin/env bash
# The test suite, as CI runs it. Tests that start a real mooncake_master run
# inside a private network namespace when we can make one (root + unshare), so
# nothing they start listens beyond this machine's test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pytest -q -m "not real_master" "$@"
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null; then
  echo "real-master tests in a private network namespace:"
  unshare -n sh -c "ip link set lo up && exec '$PY' -m pytest -q -m real_master $*"
else
  "$PY" -m pytest -q -m real_master "$@"
fi
