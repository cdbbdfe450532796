#!/usr/bin/env bash
# Create .venv-openenv at the repo root: the venv of OpenEnv environment servers (PyPI `openenv-core`,
# e.g. examples/environments/openenv_guess.py), apart from .venv (which it never touches). The workers
# of the `openenv` workflow need none of it: they speak the protocol with aiohttp from .venv.
#   scripts/install_openenv.sh [--lazy-bytecode]   (the option: as in scripts/install.sh)
# Exact versions, sha256-checked, come from requirements/openenv.lock (scripts/lock.sh, from
# requirements/openenv.in). Re-running is cheap: nothing happens while the lock is unchanged.
# Downloads go through uv's cache (UV_CACHE_DIR, default ~/.cache/uv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv_stamp.sh
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) bytecode_option "$arg" || { echo "[install_openenv] unknown argument '$arg' (options: --lazy-bytecode, --help)" >&2; exit 2; } ;;
  esac
done
venv=".venv-openenv"
lock="requirements/openenv.lock"
[ -f "$lock" ] || { echo "[install_openenv] $lock is missing: make it with scripts/lock.sh" >&2; exit 2; }
py="${PYTHON:-python3}"
want="openenv-$(sha256sum "$lock" | cut -c1-16)"
if venv_current "$venv" "$want"; then
  exit 0
fi
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  echo "[install_openenv] creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
echo "[install_openenv] $lock into $venv" >&2
rm -f "$venv/.astraflow-lock"
scripts/uv.sh pip sync --python "$venv/bin/python" --require-hashes $(bytecode_flags) "$lock"
"$venv/bin/python" -c "import openenv.core.env_server, sys; from importlib.metadata import version; print(f'[install_openenv] openenv-core {version(\"openenv-core\")}', file=sys.stderr)"
venv_stamp "$venv" "$want"
echo "[install_openenv] done in $((SECONDS - start)) s" >&2
