#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole CPU test suite. GPU-only tests skip without CUDA;
# Triton kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it on CPU).
#
# With no arguments the suite runs as four pytest processes, one per group of test folders, in two lanes of two
# groups run side by side (TEST_LANES=1: one after another). Every engine a test builds leaves a few hundred MB
# resident (allocator arenas, compiled kernels, the interpreter's caches): one process for all ~1,950 tests
# peaked at 13-16 GB, the heaviest group (kernels) at 8.8 GB, and two lanes side by side at 15.0 GB of the
# machine's memory in use (2026-12-06, 23 GB machine). Much of the suite is single-threaded Python (the Triton
# interpreter, the scheduler, subprocess start-up), so two lanes fill two cores where one left one idle (13.5
# against 22.3 min there); the engines' thread governor (roofline/cpu.py) drops to one thread while the other
# lane is busy. Each lane's output is printed when the lane ends. The exit status is the
# first failing group's; every group runs. With arguments: one pytest process with them
# (`bash scripts/test.sh tests/moe -k router`).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
GROUPS_=(
  "kernels, attention, layers, quant, cost model, bench:tests/kernels tests/attention tests/layers tests/quant tests/costmodel tests/bench"
  "cpu, moe, distributed, worker, engine:tests/cpu tests/moe tests/distributed tests/worker tests/engine"
  "speculative decoding, server:tests/spec_decode tests/server"
  "top level:$(ls tests/test_*.py | tr '\n' ' ')"
)
listed=" ${GROUPS_[*]} "
for d in tests/*/; do  # a new test folder must join a group, or it would silently not run
  if ls "$d"test_*.py >/dev/null 2>&1 && [[ "$listed" != *" ${d%/} "* && "$listed" != *":${d%/} "* ]]; then
    echo "scripts/test.sh: ${d%/} is in no test group: add it to GROUPS_" >&2
    exit 2
  fi
done
# Two lanes: the kernel group (the largest peak) beside the engine-heavy ones, balanced by their time.
LANES=("0 3" "1 2")
[ "${TEST_LANES:-2}" = 1 ] && LANES=("0 1 2 3")
run_lane() {  # LANE_INDEX GROUP_INDEX...: each group's pytest in turn; its exit status into the lane's rc file
  local lane=$1; shift
  for i in "$@"; do
    local group=${GROUPS_[$i]}
    echo "=== tests: ${group%%:*}"
    # shellcheck disable=SC2086 # the group's paths are words
    .venv/bin/python -m pytest -q ${group#*:}
    echo $? > "$tmp/rc$i"
  done
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pids=()
for l in "${!LANES[@]}"; do
  # shellcheck disable=SC2086 # the lane's group indices are words
  run_lane $l ${LANES[$l]} > "$tmp/lane$l.log" 2>&1 &
  pids+=($!)
done
for l in "${!LANES[@]}"; do
  wait "${pids[$l]}"
  cat "$tmp/lane$l.log"
done
status=0
echo "=== tests: summary"
for i in "${!GROUPS_[@]}"; do
  rc=$(cat "$tmp/rc$i" 2>/dev/null || echo 255)
  echo "  ${GROUPS_[$i]%%:*}: $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (pytest exit $rc)")"
  [ "$rc" -ne 0 ] && [ $status -eq 0 ] && status=$rc
done
exit $status
