#!/usr/bin/env bash
# Repeat chosen tests N times, each repetition a whole scripts/test.sh run (install check, its own fresh broker
# unless one answers), and report the pass rate: one line per repetition, then one JSON line
#   {"metric": "flake_hunt", "tests": "...", "runs": N, "passed": P, "pass_rate": P/N, "exit_codes": [...],
#    "wall_s": [...]}
# Exits 0 only when every repetition passed.
#   scripts/flake_hunt.sh N [pytest args...]   e.g. scripts/flake_hunt.sh 5 tests/faults/test_broker_outage.py
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage="usage: scripts/flake_hunt.sh N TEST [pytest args...] (N >= 1 repetitions of scripts/test.sh TEST ...)"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "$usage"
  exit 0
fi
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "$usage" >&2
  exit 2
fi
runs=$1; shift
codes=(); walls=(); passed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  bash scripts/test.sh "$@" > "${TMPDIR:-/tmp}/flake_hunt.$$.$i.log" 2>&1
  code=$?
  wall=$(( $(date +%s) - start ))
  codes+=("$code"); walls+=("$wall")
  [ "$code" = 0 ] && passed=$((passed + 1))
  echo "[flake_hunt] run $i/$runs: exit $code in ${wall} s (log ${TMPDIR:-/tmp}/flake_hunt.$$.$i.log)" >&2
done
join() { local IFS=,; echo "$*"; }
rate=$(python3 -c "print(round($passed / $runs, 4))")
tests=$(printf '%s ' "$@" | sed 's/ $//; s/\\/\\\\/g; s/"/\\"/g')
echo "{\"metric\": \"flake_hunt\", \"tests\": \"$tests\", \"runs\": $runs, \"passed\": $passed, \"pass_rate\": $rate, \"exit_codes\": [$(join "${codes[@]}")], \"wall_s\": [$(join "${walls[@]}")]}"
[ "$passed" = "$runs" ]
