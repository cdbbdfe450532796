#!/usr/bin/env bash
# Create .venv at the repo root with exactly the versions in
# requirements/<PROFILE>.lock, then install AstraFlow itself (editable, no deps).
# Re-running is cheap: nothing happens while the lock and setup.cfg are unchanged.
#   scripts/install.sh [PROFILE] [--lazy-bytecode]
#     PROFILE: dev (default, what CI uses) | gpu | tracking | bench
#     --lazy-bytecode: do not compile every installed module to bytecode up front (~90 s of CPU for dev);
#       each is compiled on its first import instead, and cached only where PYTHONDONTWRITEBYTECODE is
#       unset (scripts/test.sh: a test run imports ~20% of the modules). A venv installed either way counts.
# Unlocked installs are plain pip: `pip install astraflow` or `pip install -e '.[dev]'`.
# Refresh the locks with scripts/lock.sh (a deliberate commit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
profile=dev
compile=eager
for arg in "$@"; do
  case "$arg" in
    --lazy-bytecode) compile=lazy ;;
    -*) echo "[install] unknown option '$arg' (options: --lazy-bytecode)" >&2; exit 2 ;;
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
stamp=".venv/.astraflow-lock"
want="$profile-$(cat "$lock" setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
# the stamp is "<want> eager|lazy": a lazy install is enough for --lazy-bytecode, only an eager one otherwise
have="$(cat "$stamp" 2>/dev/null || true)"
if [ -x .venv/bin/python ] && { [ "$have" = "$want eager" ] || { [ "$compile" = lazy ] && [ "$have" = "$want lazy" ]; }; }; then
  exit 0
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
echo "[install] $lock into .venv (torch is large: this can take several minutes)" >&2
rm -f "$stamp"
# --compile-bytecode: every process would otherwise compile what it imports from source (torch alone
# ~3 s of CPU), and again in each process where PYTHONDONTWRITEBYTECODE is set.
bytecode=(--compile-bytecode)
[ "$compile" = eager ] || bytecode=()
scripts/uv.sh pip sync --python .venv/bin/python --require-hashes "${bytecode[@]}" "$lock"
scripts/uv.sh pip install --python .venv/bin/python --no-deps -e .
echo "$want $compile" > "$stamp"
