#!/usr/bin/env bash
# Installs everything AutoMoE needs on a fresh Debian 12 machine: the Debian build packages and a
# Python virtual environment in .venv with the pinned requirements. Idempotent and quick when
# nothing changed (a stamp records the requirements that were installed).
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(cmake g++ ninja-build ccache nlohmann-json3-dev libgtest-dev python3-venv python3-dev libjemalloc2
      universal-ctags  # scripts/check_sizes.py (function lengths)
      clang lld libclang-rt-14-dev)  # the last three: scripts/fuzz.sh (libFuzzer, sanitizers)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.automoe-requirements
if ! cmp -s requirements.txt "$stamp"; then
  echo "setup: installing Python requirements into .venv (first time: a few minutes)"
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  cp requirements.txt "$stamp"
fi

# `.venv/bin/automoe` runs this checkout's package, as the console script of `pip install .` would.
wrapper="#!/bin/sh
# Written by scripts/setup.sh: the automoe command of the checkout at $PWD.
PYTHONPATH=\"$PWD/python\${PYTHONPATH:+:\$PYTHONPATH}\" exec \"$PWD/.venv/bin/python\" -m automoe.cli \"\$@\""
if [ "$(cat .venv/bin/automoe 2>/dev/null)" != "$wrapper" ]; then
  printf '%s\n' "$wrapper" > .venv/bin/automoe
  chmod +x .venv/bin/automoe
fi
