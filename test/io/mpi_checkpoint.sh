#!/usr/bin/env bash
# The MPI <-> in-process checkpoint test (mpi_checkpoint_main.cpp): saved by two MPI processes,
# loaded by two thread ranks and saved again, loaded by two MPI processes.
#   mpi_checkpoint.sh <program> <work dir> <mpirun> [mpirun args...]
set -euo pipefail
program=$1
work=$2
shift 2
rm -rf "$work"
mkdir -p "$work"
seed=${STRATA_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "seed $seed (STRATA_TEST_SEED=$seed reproduces this run)"
"$@" 2 "$program" mpi-save "$work" "$seed"
"$program" local "$work" "$seed"
"$@" 2 "$program" mpi-load "$work" "$seed"
rm -rf "$work"
