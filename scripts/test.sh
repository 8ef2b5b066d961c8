#!/usr/bin/env bash
# Builds strata and runs its whole test suite (quick and slow). Extra arguments go to ctest,
# e.g. scripts/test.sh -L quick.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j 2
ctest --test-dir build --output-on-failure "$@"
