#!/usr/bin/env bash
# Run the whole test suite. Installs .venv, .venv-vllm and .venv-openenv if needed and starts a local Kafka
# broker (scripts/kafka-local.sh start --fresh: no topic of earlier runs) when none answers on
# 127.0.0.1:${KAFKA_PORT:-9092}; a broker this script started is stopped at the end. Tests run on PYTEST_WORKERS
# processes (pytest-xdist; 0 runs them in this process). The default is 3 on a 2-core CI machine: with 2
# the cores were busy 68% of the suite (its tests wait on restarts, outages and tool latency), which took
# 26.5 min; with 3 it took 17.6 min (2026-12-04).
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Bytecode is compiled on first import and cached (PYTHONDONTWRITEBYTECODE unset below), not for every
# installed module up front: the suite imports ~20% of them, and compiling all took ~3 of CI's 30 minutes.
scripts/install.sh dev --lazy-bytecode
scripts/install_vllm.sh --lazy-bytecode   # vLLM's CPU backend in .venv-vllm, for the vLLM engine's tests and example
scripts/install_openenv.sh --lazy-bytecode   # openenv-core in .venv-openenv, serving the OpenEnv workflow's test game
# Debian's docker-compose validates docker-compose.yml offline (tests/astraflow/test_deploy.py; no engine runs here)
if ! command -v docker-compose >/dev/null 2>&1; then
  source scripts/apt_install.sh
  echo "[test] installing docker-compose (Debian package) to validate docker-compose.yml" >&2
  apt_install docker-compose
fi
started=0
if ! scripts/kafka-local.sh status >/dev/null 2>&1; then
  scripts/kafka-local.sh start --fresh
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then scripts/kafka-local.sh stop || true; fi; }
trap cleanup EXIT
export ASTRAFLOW_TEST_KAFKA="127.0.0.1:${KAFKA_PORT:-9092}"
# The suite starts hundreds of Python processes: each module they import is compiled once, by the first.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-3}" --dist worksteal --durations=30 "$@"
