#!/bin/sh
# Install kapitsa into its own environment and put the `kapitsa` command on PATH.
#
#   sh install.sh                  from a clone: install that checkout; elsewhere: the published package
#   sh install.sh --from PATH      install the checkout at PATH
#   sh install.sh --package SPEC   install the published package (SPEC: kapitsa, kapitsa==0.2.0, ...)
#   sh install.sh --cuda           Linux only: add MLX's CUDA build (the `cuda` extra)
#   sh install.sh --uninstall      remove the environment and the command link (settings, state and models stay)
#   sh install.sh --purge          --uninstall, and also remove kapitsa's state folder (logs, prefix cache)
#
# Where things go (override with environment variables):
#   KAPITSA_HOME     ~/.kapitsa         the environment lives in $KAPITSA_HOME/venv
#   KAPITSA_BIN_DIR  ~/.local/bin       the `kapitsa` link
#   KAPITSA_PYTHON   (auto)             the Python (>= 3.11) to build the environment from
#
# Running it again upgrades in place. It uses uv when uv is on PATH, else `python3 -m venv` and pip.
set -eu

KAPITSA_HOME="${KAPITSA_HOME:-$HOME/.kapitsa}"
KAPITSA_BIN_DIR="${KAPITSA_BIN_DIR:-$HOME/.local/bin}"
VENV="$KAPITSA_HOME/venv"
LINK="$KAPITSA_BIN_DIR/kapitsa"

say() { printf '%s\n' "kapitsa-install: $*"; }
die() { printf '%s\n' "kapitsa-install: error: $*" >&2; exit 1; }

usage() {
  cat <<'USAGE'
usage: sh install.sh [--from PATH | --package SPEC] [--cuda]
       sh install.sh --uninstall | --purge
From a clone it installs that checkout; elsewhere the published package `kapitsa`.
Environment: KAPITSA_HOME (~/.kapitsa), KAPITSA_BIN_DIR (~/.local/bin), KAPITSA_PYTHON (>= 3.11).
USAGE
}

# True when $1 is a kapitsa source checkout (its pyproject names the project `kapitsa`).
is_checkout() { [ -f "$1/pyproject.toml" ] && grep -q '^name = "kapitsa"' "$1/pyproject.toml"; }

check_platform() {
  os=$(uname -s)
  arch=$(uname -m)
  case "$os" in
    Darwin)
      if [ "$(sysctl -n sysctl.proc_translated 2>/dev/null || echo 0)" = 1 ]; then
        die "this shell runs under Rosetta (x86_64); open a native arm64 terminal and run it again"
      fi
      [ "$arch" = arm64 ] || die "kapitsa needs a Mac with Apple silicon (arm64); this one is $arch"
      macos_major=$(sw_vers -productVersion | cut -d. -f1)
      [ "$macos_major" -ge 14 ] || die "MLX needs macOS 14 (Sonoma) or newer; this is $(sw_vers -productVersion)"
      say "macOS $(sw_vers -productVersion) on Apple silicon: MLX runs on the GPU (Metal)"
      ;;
    Linux)
      say "Linux ($arch): development install, MLX runs on the CPU (add --cuda for an NVIDIA GPU)"
      ;;
    *)
      die "unsupported system $os: kapitsa runs on macOS arm64 (and on Linux for development)"
      ;;
  esac
}

# Prints the first Python >= 3.11 found, or nothing.
find_python() {
  for candidate in "${KAPITSA_PYTHON:-}" python3.14 python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
}

# The environment survives re-runs; one whose interpreter no longer starts (Python upgraded) is rebuilt.
venv_is_usable() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

make_venv() {
  if venv_is_usable; then
    say "reusing the environment in $VENV"
    return 0
  fi
  rm -rf "$VENV"
  mkdir -p "$KAPITSA_HOME"
  if [ -n "$UV" ]; then
    say "creating the environment in $VENV (uv)"
    "$UV" venv --quiet --python "${KAPITSA_PYTHON:->=3.11}" "$VENV"
    return 0
  fi
  python=$(find_python)
  [ -n "$python" ] || die "no Python >= 3.11 found: install uv (https://docs.astral.sh/uv/) or Python 3.11+, or set KAPITSA_PYTHON"
  say "creating the environment in $VENV ($python -m venv)"
  "$python" -m venv "$VENV" || die "'$python -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
}

install_package() {
  spec=$1
  if [ -n "$UV" ]; then
    "$UV" pip install --quiet --python "$VENV/bin/python" --upgrade --refresh-package kapitsa --reinstall-package kapitsa "$spec"
  else
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$spec"
  fi
}

# Refuses to replace a `kapitsa` command that another installer (brew, pipx) put there.
check_link_is_ours() {
  if [ -e "$LINK" ] || [ -L "$LINK" ]; then
    case "$(readlink "$LINK" 2>/dev/null || true)" in
      "$VENV"/*) ;;
      *) die "$LINK exists and was not made by this installer; remove it (or set KAPITSA_BIN_DIR) and run again" ;;
    esac
  fi
}

link_command() {
  mkdir -p "$KAPITSA_BIN_DIR"
  ln -sf "$VENV/bin/kapitsa" "$LINK"
}

uninstall() {
  removed=no
  if [ -L "$LINK" ]; then
    case "$(readlink "$LINK")" in
      "$VENV"/*) rm -f "$LINK"; removed=yes; say "removed $LINK" ;;
    esac
  fi
  if [ -d "$VENV" ]; then
    rm -rf "$VENV"
    removed=yes
    say "removed $VENV"
  fi
  rmdir "$KAPITSA_HOME" 2>/dev/null || true
  [ "$removed" = yes ] || say "nothing to uninstall in $KAPITSA_HOME"
  [ -d "$KAPITSA_HOME" ] && say "kept $KAPITSA_HOME (your settings); downloaded models stay in the Hugging Face cache"
  report_state
  return 0
}

# kapitsa's state folder (server logs, the prefix cache, the token fallback), as kapitsa/settings.py finds it.
state_dir() {
  if [ -n "${KAPITSA_STATE_DIR:-}" ]; then printf '%s\n' "$KAPITSA_STATE_DIR"
  elif [ "$(uname -s)" = Darwin ]; then printf '%s\n' "$HOME/Library/Application Support/kapitsa"
  else printf '%s\n' "${XDG_STATE_HOME:-$HOME/.local/state}/kapitsa"; fi
}

# Says what the state folder holds and whether it stays; --purge removes it.
report_state() {
  state=$(state_dir)
  [ -d "$state" ] || return 0
  size=$(du -sh "$state" 2>/dev/null | cut -f1)
  if [ "$purge" = yes ]; then
    rm -rf "$state"
    say "removed $state ($size: logs, prefix cache, token fallback)"
  else
    say "kept $state ($size: logs, prefix cache, token fallback); remove it too with: sh install.sh --purge"
  fi
}

# Sets action, source_dir, package and extra from the command line.
parse_args() {
  action=install source_dir="" package="" extra="" purge=no
  while [ $# -gt 0 ]; do
    case "$1" in
      --from) [ $# -ge 2 ] || die "--from needs a path"; source_dir=$2; shift 2 ;;
      --package) [ $# -ge 2 ] || die "--package needs a requirement, e.g. kapitsa==0.1.0"; package=$2; shift 2 ;;
      --cuda) extra="[cuda]"; shift ;;
      --uninstall) action=uninstall; shift ;;
      --purge) action=uninstall; purge=yes; shift ;;
      -h|--help) usage; exit 0 ;;
      *) die "unknown option: $1 (see --help)" ;;
    esac
  done
  [ -z "$source_dir" ] || [ -z "$package" ] || die "give --from or --package, not both"
}

# Prints what to hand to pip: a checkout folder, or a requirement on the published package.
resolve_spec() {
  if [ -z "$source_dir" ] && [ -z "$package" ]; then
    here=$(cd "$(dirname "$0")" && pwd)
    if is_checkout "$here"; then source_dir=$here; else package=kapitsa; fi
  fi
  if [ -n "$source_dir" ]; then
    source_dir=$(cd "$source_dir" 2>/dev/null && pwd) || die "--from: no such folder"
    is_checkout "$source_dir" || die "$source_dir is not a kapitsa checkout (no pyproject.toml naming kapitsa)"
  fi
  if [ -n "$extra" ]; then
    [ "$(uname -s)" = Linux ] || die "--cuda is for Linux with an NVIDIA GPU"
  fi
  if [ -n "$source_dir" ]; then
    if [ -n "$extra" ]; then printf '%s\n' "kapitsa$extra @ file://$source_dir"; else printf '%s\n' "$source_dir"; fi
  else
    printf '%s\n' "$package" | sed "s/^kapitsa/kapitsa$extra/"
  fi
}

report_path() {
  case ":$PATH:" in
    *":$KAPITSA_BIN_DIR:"*) say "start it with: kapitsa" ;;
    *) say "$KAPITSA_BIN_DIR is not on your PATH: start it with $LINK, or add to your shell profile:"
       say "  export PATH=\"$KAPITSA_BIN_DIR:\$PATH\"" ;;
  esac
}

main() {
  parse_args "$@"
  if [ "$action" = uninstall ]; then
    uninstall
    return 0
  fi
  spec=$(resolve_spec)
  check_platform
  check_link_is_ours
  UV=$(command -v uv 2>/dev/null || true)
  make_venv
  say "installing $spec"
  install_package "$spec"
  [ -x "$VENV/bin/kapitsa" ] || die "the install finished but $VENV/bin/kapitsa is missing"
  link_command
  say "installed: $("$LINK" --version) -> $LINK"
  report_path
}

main "$@"
