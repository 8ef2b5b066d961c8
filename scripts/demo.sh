#!/usr/bin/env bash
# Builds strata and runs the demo: the communicator demo, then a character-level GPT trained
# under a hybrid layout on in-process ranks (extra arguments go to strata_train_gpt, e.g.
# --steps 100 --dp 2 --tp 2 --pp 2 --zero 3 --precision bf16; see examples/train_gpt.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j 2 --target strata_comm_demo
build/examples/strata_comm_demo
cmake --build build -j 2 --target strata_train_gpt
build/examples/strata_train_gpt "$@"
