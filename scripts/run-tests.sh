#!/usr/bin/env bash
# The test suite, as CI runs it (make test), in named phases: each says what it
# runs before it starts and how long it took when it ends, and a summary ends
# the run (how long it took when last measured: docs/benchmarks.md; pytest's -q
# dots inside a phase). Every phase runs even when an earlier one failed; the
# exit code is non-zero if any did. Extra arguments go to every pytest run (e.g. -x).
#
# Test files are listed by phase below; a tests/test_*.py not listed runs in
# "other tests", so none is ever left out. Tests that start a real
# mooncake_master (-m real_master) or a real vllm serve (-m live_server) run
# last, inside a private network namespace when we can make one (root +
# unshare), so nothing they start listens beyond this machine's test.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# In-process replays (replay_on in a test) take the CLI's pinned interpreter hash seed.
export PYTHONHASHSEED=0
# check --recompute's two references one after the other: two xdist workers
# already take both cores, and a second engine process costs its own start.
export PREFIX_REPLAYER_SERIAL_REFERENCES=1

# One warm server for the whole run, in a runtime directory of its own: every
# CLI call, the plugin and replayer.pytest.testing replay on forks of engines imported
# once (replayer/replay/execution/warm), instead of ~12 s of imports each. Tests that
# are about a cold start say PREFIX_REPLAYER_NO_SERVER=1 or start their own.
PREFIX_REPLAYER_RUNTIME_DIR=$(mktemp -d /tmp/replayer-run.XXXXXX)
export PREFIX_REPLAYER_RUNTIME_DIR
stop_server() {
  "$PY" -m replayer server stop >/dev/null 2>&1
  rm -rf "$PREFIX_REPLAYER_RUNTIME_DIR"
}
trap stop_server EXIT
echo "=== warm server for this run (replayer server start, runtime dir $PREFIX_REPLAYER_RUNTIME_DIR)"
start=$SECONDS
"$PY" -m replayer server start || { echo "the warm server did not start"; exit 1; }
echo "=== warm server ready in $((SECONDS - start)) s"

UNITS="tests/test_traces_*.py tests/test_cli_errors.py tests/test_cli_version.py
       tests/test_engines_specs.py tests/test_recorder_writer.py tests/test_store_memory.py
       tests/test_schedule.py tests/test_golden_update.py tests/test_layers.py"
INSTALLED="tests/test_replay.py tests/test_anonymize.py tests/test_store_ops.py
           tests/test_store_errors.py tests/test_store_real_master.py tests/test_offloading.py"
RECORDER="tests/test_recorder_roundtrip.py tests/test_recorder_kill.py"
ENGINES="tests/test_engines_replay.py"
# vLLM's own model runner (--worker model) in .venv-serve: a phase of its own,
# one test file per xdist worker.
MODEL_WORKER="tests/test_model_worker.py tests/test_recompute.py"
PLUGIN="tests/test_pytest_plugin.py tests/test_testing_api.py"
README="tests/test_readme.py"

listed=" "
for f in $UNITS $INSTALLED $RECORDER $ENGINES $MODEL_WORKER $PLUGIN $README; do listed+="$f "; done
OTHERS=""
for f in tests/test_*.py; do
  [[ "$listed" == *" $f "* ]] || OTHERS+="$f "
done

existing() { for f in "$@"; do [ -e "$f" ] && printf '%s ' "$f"; done; }

PHASES=10
[ -n "$OTHERS" ] && PHASES=11
n=0
summary=()
failed=0
phase() {  # phase NAME COMMAND...
  local name=$1; shift
  n=$((n + 1))
  echo
  echo "=== phase $n/$PHASES: $name"
  local start=$SECONDS rc=0
  "$@" || rc=$?
  local took=$((SECONDS - start))
  if [ "$rc" = 0 ] || { [ "$rc" = 5 ] && [ "${ALLOW_EMPTY:-0}" = 1 ]; }; then
    echo "=== phase $n/$PHASES: $name: passed in ${took} s"
    summary+=("passed  $(printf '%5d' "$took") s  $name")
  else
    echo "=== phase $n/$PHASES: $name: FAILED (exit $rc) after ${took} s"
    summary+=("FAILED  $(printf '%5d' "$took") s  $name")
    failed=1
  fi
}

pytest_phase() {  # pytest_phase NAME FILES... (no real_master tests)
  local name=$1; shift
  local files; files=$(existing "$@")
  if [ -z "$files" ]; then
    phase "$name" true
    return
  fi
  # 5 (nothing collected) is fine here: a file may hold only real_master tests.
  # shellcheck disable=SC2086
  ALLOW_EMPTY=1 phase "$name" "$PY" -m pytest -q "${DURATIONS[@]}" -m "not real_master and not live_server" $files "${ARGS[@]}"
}

ARGS=("$@")
# Two xdist workers for a phase whose tests spend their time in CLI children, one
# core each (releases are fetched and commits exported under file locks; each
# console block runs in a private copy): about half the wall time on 2 cores.
# --dist worksteal: a worker that runs out takes half of the other's queue, so a
# phase no longer ends on one worker with a minutes-long test still queued behind
# the one it runs (xdist's default, load, keeps two queued per worker).
TWO_WORKERS=(-n 2 --dist worksteal)
on_two_workers() {  # on_two_workers pytest_phase NAME FILES...
  local saved=("${ARGS[@]}")
  ARGS=("${TWO_WORKERS[@]}" "${saved[@]}")
  "$@"
  ARGS=("${saved[@]}")
}
# The slowest tests of each phase, so a CI log says where its time went.
DURATIONS=(--durations=12 --durations-min=15)
fetch_releases() {
  "$PY" -c 'from replayer.replay.engines.sources.releases import release_sources
for v in ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):
    print(f"vllm=={v}: {release_sources(v)}")'
}

# Only the files that mark tests real_master or live_server: collecting all of tests/
# in each xdist worker imported vLLM and every other test module for nothing.
real_master() {
  local marked; marked=$(grep -l -E 'mark\.(real_master|live_server)' tests/test_*.py | tr '\n' ' ')
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null; then
    # A warm server of the namespace's own: forks of the run's server live outside
    # it and could not reach a master on its loopback.
    echo "(inside a private network namespace: unshare -n, ip link set lo up, a server of its own)"
    unshare -n sh -c "ip link set lo up && export PREFIX_REPLAYER_RUNTIME_DIR=\$(mktemp -d /tmp/replayer-ns.XXXXXX) \
      && '$PY' -m replayer server start --lazy >/dev/null \
      && { '$PY' -m pytest -q ${TWO_WORKERS[*]} ${DURATIONS[*]} -m 'real_master or live_server' $marked ${ARGS[*]}; rc=\$?; \
           '$PY' -m replayer server stop >/dev/null; rm -rf \"\$PREFIX_REPLAYER_RUNTIME_DIR\"; exit \$rc; }"
  else
    "$PY" -m pytest -q "${TWO_WORKERS[@]}" "${DURATIONS[@]}" -m "real_master or live_server" $marked "${ARGS[@]}"
  fi
}

# The release sources download while the first phases run (pip's downloads wait
# on the network, not the cores; a test that needs a release first takes the same
# file lock and waits for it). Phase 4 waits for it and prints what it said.
RELEASES_LOG=$PREFIX_REPLAYER_RUNTIME_DIR/fetch-releases.log
fetch_releases >"$RELEASES_LOG" 2>&1 &
RELEASES_PID=$!
wait_for_releases() {
  local rc=0
  wait "$RELEASES_PID" || rc=$?
  cat "$RELEASES_LOG"
  return "$rc"
}

# shellcheck disable=SC2086
{
pytest_phase "traces, command line, specs, step clock, golden updates, recorder writer, memory store (no vLLM replay)" $UNITS
on_two_workers pytest_phase "replays on the installed vLLM 0.33.0 (store tests without a master included), on 2 xdist workers" $INSTALLED
on_two_workers pytest_phase "recorder: round trips and kill -9, on 2 xdist workers" $RECORDER
phase "fetch vLLM 0.26.0-0.34.0 release sources (once per cache, ~2.7 GB of downloads; started in the background with phase 1)" wait_for_releases
on_two_workers pytest_phase "replays on vLLM releases and source trees, on 2 xdist workers" $ENGINES
# Two xdist workers, tests dealt out one by one: each worker starts its own engine
# processes for test_model_worker.py (its module fixture), and much of a
# model-worker step is single-threaded Python (the scheduler, vLLM's Mamba kernels
# under Triton's interpreter). A file per worker (--dist loadfile) took 575 s:
# test_model_worker.py alone is most of it. xdist's default (load), not worksteal:
# load deals tests in file order, so no worker comes back to test_model_worker.py
# after leaving it, which would start that module's engines over again.
TWO_WORKERS=(-n 2)
on_two_workers pytest_phase "model worker: vLLM's own model runner in .venv-serve, held to the null executor; check --recompute and planted faults, on 2 xdist workers" $MODEL_WORKER
TWO_WORKERS=(-n 2 --dist worksteal)
on_two_workers pytest_phase "pytest plugin and replayer.pytest.testing (pytest runs in subprocesses, -n 2 included), on 2 xdist workers" $PLUGIN
# On the installed vLLM only: every fixture on vllm==0.29.0 is docs/engines.md's
# console block (check --engine vllm==0.29.0 fixtures/, its exit code 0 included).
golden_fixtures() {  # nothing collected (exit 5) means the plugin is not registered: a failure
  "$PY" -m pytest -q "${TWO_WORKERS[@]}" fixtures/ --replayer-engine installed \
    "${ARGS[@]}" && return 0
  local rc=$?
  [ "$rc" = 5 ] && echo "no fixture collected: is the pytest11 entry point installed? (pip install -e .)"
  return "$rc"
}
phase "golden fixtures through the plugin: pytest fixtures/ on installed, on 2 xdist workers" \
  golden_fixtures
on_two_workers pytest_phase "console blocks of README.md and docs/ (tests/test_readme.py), on 2 xdist workers" $README
if [ -n "$OTHERS" ]; then
  on_two_workers pytest_phase "other tests, on 2 xdist workers: $OTHERS" $OTHERS
fi
phase "real-master and live-server tests (a real mooncake_master; a real vllm serve from .venv-serve, each on a port of its own), on 2 xdist workers" real_master
}

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
