#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole CPU test suite. GPU-only tests skip without CUDA;
# Triton kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it on CPU).
#
# With no arguments the suite runs as four pytest processes, one after another: every engine a test builds
# leaves a few hundred MB resident (allocator arenas, compiled kernels, the interpreter's caches), and one process
# for all ~1,950 tests peaked at 13-16 GB, too close to a 24 GB CI machine's limit. Four processes peak at about
# 8 GB (the kernel group) and cost about a minute more (each loads the session fixtures again). The exit status is
# the first failing group's; every group runs. With arguments: one pytest process with them
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
status=0
summary=()
for group in "${GROUPS_[@]}"; do
  name=${group%%:*}
  echo "=== tests: $name"
  # shellcheck disable=SC2086 # the group's paths are words
  .venv/bin/python -m pytest -q ${group#*:}
  rc=$?
  summary+=("  $name: $([ $rc -eq 0 ] && echo passed || echo "FAILED (pytest exit $rc)")")
  [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
done
echo "=== tests: summary"
printf '%s\n' "${summary[@]}"
exit $status
