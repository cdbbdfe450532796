#!/usr/bin/env bash
# Create .venv at the repo root and install AstraFlow with its dev extra.
# Re-running is cheap: the install is skipped while setup.cfg is unchanged.
#   scripts/install.sh [EXTRAS]     (default EXTRAS: dev)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-dev}"
py="${PYTHON:-python3}"
stamp=".venv/.astraflow-deps"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-$extras"
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
echo "[install] pip install -e '.[$extras]' into .venv (torch is large: this can take several minutes)" >&2
.venv/bin/pip install --progress-bar off -q -e ".[$extras]"
echo "$want" > "$stamp"
