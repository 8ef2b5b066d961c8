#!/usr/bin/env bash
# Builds strata and runs the demo (for now the communicator demo).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j 2 --target strata_comm_demo
build/examples/strata_comm_demo
