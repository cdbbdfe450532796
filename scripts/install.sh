#!/usr/bin/env bash
# Create .venv at the repo root with exactly the versions in
# requirements/<PROFILE>.lock, then install AstraFlow itself (editable, no deps).
# Re-running is cheap: nothing happens while the lock and setup.cfg are unchanged.
#   scripts/install.sh [PROFILE] [--lazy-bytecode] [--deps-only]
#     PROFILE: dev (default, what CI uses) | gpu | tracking | bench
#     --deps-only: install the lock's packages but not AstraFlow itself (the Dockerfile's layer of dependencies,
#       which then outlives changes to the code); a later run without it only installs AstraFlow.
#     --lazy-bytecode: do not compile every installed module to bytecode up front (~90 s of CPU for dev);
#       each is compiled on its first import instead, and cached only where PYTHONDONTWRITEBYTECODE is
#       unset (scripts/test.sh: a test run imports ~20% of the modules). A venv installed either way counts.
# Unlocked installs are plain pip: `pip install astraflow` or `pip install -e '.[dev]'`.
# Refresh the locks with scripts/lock.sh (a deliberate commit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv_stamp.sh
profile=dev
deps_only=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --deps-only) deps_only=1 ;;
    -*) bytecode_option "$arg" || { echo "[install] unknown option '$arg' (options: --lazy-bytecode, --deps-only, --help)" >&2; exit 2; } ;;
    *) profile="$arg" ;;
  esac
done
lock="requirements/$profile.lock"
if [ ! -f "$lock" ]; then
  echo "[install] unknown profile '$profile': no $lock (profiles: $(ls requirements | sed 's/\.lock$//' | tr '\n' ' '))" >&2
  exit 2
fi
# The code sandbox (producers/sandbox.py) runs model-written code under bubblewrap; without it code
# rewards refuse to run. Installed here when missing and apt-get can (as root, or by passwordless sudo).
source scripts/apt_install.sh
if ! command -v bwrap >/dev/null 2>&1; then
  echo "[install] bubblewrap (bwrap) for the code sandbox" >&2
  apt_install bubblewrap
  if ! command -v bwrap >/dev/null 2>&1; then
    echo "[install] bubblewrap (bwrap) is missing and could not be installed here (needs apt-get as root):" \
         "install it (Debian/Ubuntu: apt-get install -y bubblewrap), or code rewards refuse to run;" \
         "ASTRAFLOW_SANDBOX=audit-hook opts into the weaker in-process sandbox" >&2
  fi
fi
py="${PYTHON:-python3}"
want="$profile-$(cat "$lock" setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if venv_current .venv "$want"; then
  exit 0
fi
if ! venv_current .venv "deps-$want"; then
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  echo "[install] $lock into .venv (torch is large: this can take several minutes)" >&2
  rm -f .venv/.astraflow-lock
  # --compile-bytecode: every process would otherwise compile what it imports from source (torch alone
  # ~3 s of CPU), and again in each process where PYTHONDONTWRITEBYTECODE is set.
  scripts/uv.sh pip sync --python .venv/bin/python --require-hashes $(bytecode_flags) "$lock"
  venv_stamp .venv "deps-$want"
fi
[ "$deps_only" = 1 ] && exit 0
scripts/uv.sh pip install --python .venv/bin/python --no-deps -e .
venv_stamp .venv "$want"
