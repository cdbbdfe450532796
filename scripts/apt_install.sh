# Sourced by scripts/install.sh and scripts/test.sh: apt_install PACKAGE... installs Debian packages when
# apt-get can (as root, or by passwordless sudo); it never fails (the caller checks for what it needed).
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && sudo="sudo -n"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; }; then
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null 2>&1 \
      || { $sudo apt-get update -qq >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null 2>&1; } \
      || true
  fi
}
