#!/usr/bin/env bash
# Installs the Debian packages strata's build, tests and benchmarks need, when any is missing,
# and the Python packages of the safetensors interop test (safetensors, numpy) when python3
# cannot import them.
set -euo pipefail
packages=(cmake ninja-build g++ catch2 libbenchmark-dev libeigen3-dev libopenblas-dev clang-format
          openmpi-bin libopenmpi-dev nlohmann-json3-dev etcd-server libcurl4-openssl-dev libgloo-dev)
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

# test/io/safetensors_interop.py reads and writes files with the reference library.
if ! python3 -c 'import safetensors, numpy' 2>/dev/null; then
  echo "strata setup: installing the Python packages safetensors and numpy"
  # Debian's python3 refuses pip installs outside a virtual environment (PEP 668) unless told.
  python3 -m pip install --quiet safetensors numpy 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages safetensors numpy
fi
