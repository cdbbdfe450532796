# Sourced by scripts/install.sh and scripts/install_vllm.sh: the --lazy-bytecode option and the venv's stamp.
# A venv's stamp (VENV/.astraflow-lock) is "<what it was installed from> eager|lazy": eager compiled every
# installed module to bytecode up front; lazy left each to its first import (cached where
# PYTHONDONTWRITEBYTECODE is unset). A lazy install is enough for --lazy-bytecode, only an eager one otherwise.

# bytecode_option ARG: sets compile=lazy for --lazy-bytecode and returns 0; returns 1 for any other ARG
compile=eager
bytecode_option() { [ "$1" = --lazy-bytecode ] && compile=lazy; }

# venv_current VENV WANT: whether VENV is installed from WANT in a way enough for $compile
venv_current() {
  local have
  have="$(cat "$1/.astraflow-lock" 2>/dev/null || true)"
  [ -x "$1/bin/python" ] && { [ "$have" = "$2 eager" ] || { [ "$compile" = lazy ] && [ "$have" = "$2 lazy" ]; }; }
}

# bytecode_flags: uv's flag for $compile (none when lazy)
bytecode_flags() { [ "$compile" = eager ] && echo --compile-bytecode || true; }

# venv_stamp VENV WANT: record a finished install
venv_stamp() { echo "$2 $compile" > "$1/.astraflow-lock"; }
