#!/usr/bin/env bash
# Run the pinned uv (https://github.com/astral-sh/uv), installing it into
# .tools/uv on first use. The pin lives here and only here.
#   scripts/uv.sh ARGS...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
UV_PIN="uv==0.13.9"
tools=".tools/uv"
if [ "$(cat "$tools/.pin" 2>/dev/null)" != "$UV_PIN" ]; then
  rm -rf "$tools"
  "${PYTHON:-python3}" -m venv "$tools"
  "$tools/bin/pip" install --progress-bar off -q "$UV_PIN"
  echo "$UV_PIN" > "$tools/.pin"
fi
exec "$tools/bin/uv" "$@"
