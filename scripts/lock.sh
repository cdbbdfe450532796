#!/usr/bin/env bash
# Refresh the locked dependency sets in requirements/ from setup.cfg.
# Run it deliberately and commit the result; CI and scripts/install.sh only
# read the locks, they never write them.
#   scripts/lock.sh [--upgrade]        (--upgrade takes the newest versions allowed)
# Profiles: dev (what CI installs), gpu (dev + the gpu extra), tracking (dev + tracking).
# Locks are for CPython 3.11 on x86_64 manylinux, with sha256 hashes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for profile in dev gpu tracking; do
  extras=(--extra dev)
  [ "$profile" = dev ] || extras+=(--extra "$profile")
  echo "[lock] requirements/$profile.lock" >&2
  scripts/uv.sh pip compile setup.cfg "${extras[@]}" "$@" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --quiet -o "requirements/$profile.lock" \
    --custom-compile-command "scripts/lock.sh"
done
