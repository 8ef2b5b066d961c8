#!/usr/bin/env bash
# Installs the Debian packages strata's build, tests and benchmarks need, when any is missing.
set -euo pipefail
packages=(cmake ninja-build g++ catch2 libbenchmark-dev libeigen3-dev libopenblas-dev clang-format
          openmpi-bin libopenmpi-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "strata setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
