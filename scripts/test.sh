#!/usr/bin/env bash
# Run the whole test suite. Installs .venv and .venv-vllm if needed and starts a local Kafka
# broker (scripts/kafka-local.sh) when none answers on 127.0.0.1:${KAFKA_PORT:-9092};
# a broker this script started is stopped at the end. Tests run on PYTEST_WORKERS
# processes (pytest-xdist; default 2, one per core of a CI machine; 0 runs them in this process).
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/install.sh dev
scripts/install_vllm.sh   # vLLM's CPU backend in .venv-vllm, for the vLLM engine's tests and example
# Debian's docker-compose validates docker-compose.yml offline (tests/astraflow/test_deploy.py; no engine runs here)
if ! command -v docker-compose >/dev/null 2>&1; then
  source scripts/apt_install.sh
  echo "[test] installing docker-compose (Debian package) to validate docker-compose.yml" >&2
  apt_install docker-compose
fi
started=0
if ! scripts/kafka-local.sh status >/dev/null 2>&1; then
  scripts/kafka-local.sh start
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then scripts/kafka-local.sh stop || true; fi; }
trap cleanup EXIT
export ASTRAFLOW_TEST_KAFKA="127.0.0.1:${KAFKA_PORT:-9092}"
# Our own modules as bytecode too: the suite starts hundreds of Python processes, and none of them writes
# bytecode where PYTHONDONTWRITEBYTECODE is set.
.venv/bin/python -m compileall -q -j 0 astraflow consumers policies producers scripts topics trainer weights tests >/dev/null
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist worksteal --durations=30 "$@"
