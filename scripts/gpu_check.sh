#!/usr/bin/env bash
# shellcheck disable=SC2317  # the parts are functions run_part calls through bash -c
# Builds and runs every GPU check and benchmark on a machine with a CUDA device (an H200 in
# about 3 minutes, 2026-12-04: docs/gpu/h200.md): the card, driver, CUDA and NCCL versions; a fresh GPU-check build
# (STRATA_BUILD_GPU_CHECKS=ON: the CUDA toolkit and NCCL only); every test of that build (the GPU
# tests, the rule test) but the trainer's; the cuda trainer against the host trainer in f64 and
# the emulated device, then data parallel and ZeRO-1 over two thread ranks on the GPU against one
# rank, with their communication's exposed time (gpu.trainer, its own part); the kernels
# benchmark; the training step
# benchmark (GPT-2 124M and 350M, bf16, MFU gates) and PyTorch eager + SDPA on the same shapes
# where torch is; the GEMM benchmark beside torch.matmul where torch is; compute-sanitizer's
# memcheck on the small kernel test. Each part's output goes to the
# terminal and to $OUT/<part>.log (./gpu_check_out without OUT), so a part that fails leaves the
# others' numbers; a summary closes the run. Exits 1 when a part failed.
#
#   scripts/gpu_check.sh                 everything
#   BUILD=dir scripts/gpu_check.sh       build there (default: build-gpu-check, made afresh)
#   GPU_CHECK_SECONDS=600 ...            the whole run's deadline (default 360)
#   GPU_CHECK_JOBS=1 ...                 build jobs (default: every core)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$(pwd)
out=${OUT:-$root/gpu_check_out}
build=${BUILD:-$root/build-gpu-check}
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-360}))
mkdir -p "$out"
summary=()
failed=0

# run_part NAME LIMIT_SECONDS command...: runs the command (a function below or a program) in
# bash under timeout, tees the output to $out/NAME.log, at most LIMIT seconds
# and never past the deadline; records the outcome for the summary.
run_part() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    summary+=("$(printf '%-22s %-10s %5s s' "$name" "NOT RUN" 0) (the run's deadline passed)")
    failed=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "==== $name (at most ${limit} s) ===="
  local start=$SECONDS
  timeout --kill-after=10 "$limit" bash -c "$*" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) status
  case $rc in
  0) status=ok ;;
  77) status=skipped ;;
  124 | 137) status=TIMEOUT failed=1 ;;
  *) status="FAILED($rc)" failed=1 ;;
  esac
  summary+=("$(printf '%-22s %-10s %5s s' "$name" "$status" "$took")")
}

versions() {
  date -u '+%Y-%m-%d %H:%M:%S UTC'
  git -C "$root" rev-parse --short HEAD 2>/dev/null | sed 's/^/strata commit /'
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  local nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
  command -v "$nvcc" >/dev/null || nvcc=nvcc
  "$nvcc" --version | tail -2
  local inc
  for inc in /usr/local/cuda/include /usr/include; do
    if [ -f "$inc/nccl.h" ]; then
      echo "NCCL $(grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' "$inc/nccl.h" | awk '{print $3}' |
        paste -sd.) ($inc/nccl.h)"
      break
    fi
  done
  cmake --version | head -1
  g++ --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' \
    2>/dev/null || echo "torch: not importable (the GEMM comparison is left out)"
}

# NCCL where the toolkit has none: the nvidia-nccl wheel beside python3's torch (its header and
# libnccl.so.2), given to CMake as NCCL_INCLUDE_DIR and NCCL_LIBRARY. Prints the two -D options.
nccl_from_wheel() {
  [ -f /usr/local/cuda/include/nccl.h ] || [ -f /usr/include/nccl.h ] && return
  local top lib inc
  top=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null) || return
  lib=$(find "$top" -name libnccl.so.2 2>/dev/null | head -1)
  inc=$(find "$top" -name nccl.h 2>/dev/null | head -1)
  [ -n "$lib" ] && [ -n "$inc" ] &&
    echo "-DNCCL_INCLUDE_DIR=$(dirname "$inc") -DNCCL_LIBRARY=$lib"
}

configure_and_build() {
  rm -rf "$build"
  local nccl
  nccl=$(nccl_from_wheel)
  [ -n "$nccl" ] && echo "gpu_check: NCCL from the wheel: $nccl"
  # shellcheck disable=SC2086  # nccl holds two options or none
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" -DSTRATA_BUILD_TESTS=OFF \
    -DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_BUILD_EXAMPLES=OFF -DSTRATA_BUILD_GPU_CHECKS=ON \
    $nccl &&
    cmake --build "$build" -j "${GPU_CHECK_JOBS:-$(nproc)}"
}

# Every test of the GPU-check build. On a machine with a device a skipped GPU test is a failure
# (it did not find the device it should have).
tests() {
  local log
  log=$(mktemp)
  ctest --test-dir "$build" --output-on-failure --no-tests=error -E '^gpu\.trainer$' 2>&1 |
    tee "$log"
  local rc=${PIPESTATUS[0]}
  if nvidia-smi -L >/dev/null 2>&1 && grep -q '(Skipped)' "$log"; then
    echo "gpu_check: a GPU test skipped on a machine with a device"
    rc=1
  fi
  rm -f "$log"
  return "$rc"
}

# The cuda trainer against the host trainer in f64 and the emulated device (ctest's gpu.trainer,
# run here on its own); skipped on a machine with a device is a failure, as in tests.
trainer() {
  local t=$build/test/gpu/strata_test_gpu_trainer
  [ -x "$t" ] || {
    echo "gpu_check: no $t (not built)"
    return 1
  }
  "$t"
  local rc=$?
  if [ "$rc" -eq 77 ] && nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: the trainer test skipped on a machine with a device"
    rc=1
  fi
  return "$rc"
}

# PyTorch eager + SDPA on the step benchmark's shapes (exits 77 without torch or a device).
torch_step() {
  python3 "$root/bench/gpu/torch_step.py"
}

gemm_bench() {
  local bench=$build/bench/gpu/strata_gemm_bench
  [ -x "$bench" ] || {
    echo "gpu_check: no $bench (not built)"
    return 1
  }
  if python3 -c 'import torch' 2>/dev/null; then
    python3 "$root/bench/gpu/torch_matmul.py" --bench "$bench" >"$out/torch_matmul.csv" &&
      "$bench" --torch "$out/torch_matmul.csv"
  else
    "$bench"
  fi
}

memcheck() {
  local cs
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -x "$cs" ] || {
    echo "gpu_check: compute-sanitizer not found: memcheck not run"
    return 77
  }
  "$cs" --tool memcheck --error-exitcode 3 "$build/test/gpu/strata_test_gpu_kernels" --small
}

export root out build
export -f versions nccl_from_wheel configure_and_build tests trainer torch_step gemm_bench memcheck
run_part versions 60 versions
run_part build 300 configure_and_build
run_part tests 120 tests
run_part trainer 150 trainer
run_part kernels_bench 90 "$build/bench/gpu/strata_kernels_bench"
run_part step_bench 120 "$build/bench/gpu/strata_step_bench"
run_part torch_step 100 torch_step
run_part gemm_bench 150 gemm_bench
run_part memcheck 150 memcheck

{
  echo "==== summary ($(date -u '+%H:%M:%S UTC'), ${SECONDS} s; logs in $out) ===="
  printf '%s\n' "${summary[@]}"
  grep -hE '^device 0:|lowest fraction|^\| (gelu|bias|residual|layer_norm|adamw)' \
    "$out/kernels_bench.log" 2>/dev/null
  grep -hE '^gemm peak|^step (124m|350m):|^(PASS|FAIL) |^torch (gemm peak|step)' \
    "$out/step_bench.log" "$out/torch_step.log" 2>/dev/null
  grep -hE "last step's communication on the device|^NCCL " "$out/trainer.log" \
    "$out/versions.log" 2>/dev/null
  grep -hE 'checks, [0-9]+ failed|ERROR SUMMARY' "$out/tests.log" "$out/trainer.log" \
    "$out/memcheck.log" 2>/dev/null
} | tee "$out/summary.log"
exit "$failed"
