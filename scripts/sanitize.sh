#!/usr/bin/env bash
# Builds strata's tests with a sanitizer in a build directory of their own and runs them:
#   scripts/sanitize.sh thread              the local backend's tests (label local) but the heavy
#                                           ones under TSan, in build-sanitize-thread/
#   scripts/sanitize.sh address,undefined   the quick suite but gpu, compile_fail, rss (resident
#                                           memory), heavy, format and rules (no code of ours
#                                           runs) and the MPI parity tests under ASan, LSan and
#                                           UBSan, in build-sanitize-address/
# Label heavy: the tests of the two executables whose compiles were half of these runs
# (strata_test_parallel, strata_test_precision; test/parallel/CMakeLists.txt).
# Extra arguments go to ctest (e.g. -R conformance, not -E or -LE, which would replace the
# mode's). Fails when a test fails, when one is skipped (ctest counts skips among the passed) or
# when none matches.
# The generator and compiler come from CMAKE_GENERATOR and CXX when set (the sanitize.* ctest
# tests set them to the outer build's), else Ninja and c++; the build type is the mode's.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

usage="usage: scripts/sanitize.sh thread|address,undefined [extra ctest args]"
if (($# < 1)); then
  echo "$usage" >&2
  exit 2
fi
mode=$1
shift
for a in "$@"; do
  if [ "$a" = -LE ] || [ "$a" = --label-exclude ] || [ "$a" = -E ] || [ "$a" = --exclude-regex ]; then
    echo "scripts/sanitize.sh: $a would replace the mode's exclusions; select with -R" >&2
    exit 2
  fi
done

# Later options win: the user's own *SAN_OPTIONS come after these defaults.
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
asan="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1"
asan+=":check_initialization_order=1:strict_init_order=1"
export ASAN_OPTIONS="$asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
lsan_options=${LSAN_OPTIONS:-}
# Open MPI leaks by design: the suppressions name only its libraries. They need whole allocation
# stacks, which the fast unwinder cannot walk through Open MPI (built without frame pointers);
# the slow unwinder costs the other tests a third of their time, so MPI tests run on their own.
mpi_lsan_options="suppressions=$root/test/sanitize/lsan_openmpi.supp:fast_unwind_on_malloc=0"
mpi_lsan_options+="${lsan_options:+:$lsan_options}"

# Each pass, split at ';': LSAN_OPTIONS, then ctest's selection (ctest 3.25 ANDs repeated -L
# but keeps only the last -LE). Every test of the mode is in exactly one pass.
passes=()
case "$mode" in
thread)
  build="$root/build-sanitize-thread"
  # Optimised: TSan finds more interleavings the faster the threads run; it compiles quickly.
  build_type=RelWithDebInfo
  configure=(-DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_BUILD_EXAMPLES=OFF)
  passes+=("$lsan_options;-L;^local$;-LE;^(gpu|sanitize|rss|heavy)$")
  ;;
address,undefined)
  build="$root/build-sanitize-address"
  # Unoptimised, with assertions: g++ 12 compiles these tests with ASan and UBSan about 4 times
  # faster at -O0 than at -O1 or -O2 (the MPI conformance test: 47 s against 3 minutes).
  build_type=Debug
  # The examples have a quick test (examples.comm_demo); the benchmarks have none.
  configure=(-DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_BUILD_EXAMPLES=ON)
  # Gloo's conformance runs on 2 and 4 processes here (3 and 8 run in the plain build: the same
  # code, 32 s more under ASan).
  passes+=("$lsan_options;-L;^quick$;-LE;^(gpu|sanitize|mpi|compile_fail|rss|heavy|format|rules)$;-E;^comm[.]gloo[.]conformance[.]np(3|8)$")
  # The MPI pass runs the backend's own tests (conformance, errors, launch) and the example, not
  # the MPI parity program (parallel.mpi.np2): the engine and strategies it runs are checked
  # under ASan by the local parity lines, and its nested -O0 compile was 150 s of the CI run.
  passes+=("$mpi_lsan_options;-L;^quick$;-L;^mpi$;-LE;^(gpu|sanitize|compile_fail|rss|parity|heavy)$")
  ;;
*)
  echo "scripts/sanitize.sh: unknown sanitizer '$mode'" >&2
  echo "$usage" >&2
  exit 2
  ;;
esac
echo "sanitize: TSAN_OPTIONS=$TSAN_OPTIONS"
echo "sanitize: ASAN_OPTIONS=$ASAN_OPTIONS"
echo "sanitize: UBSAN_OPTIONS=$UBSAN_OPTIONS"

run() {
  echo "sanitize: $*"
  "$@"
}

# CUDA stays off: the gpu tests are not run here, and nvcc code is not sanitized.
run cmake -S "$root" -B "$build" -G "${CMAKE_GENERATOR:-Ninja}" \
  -DCMAKE_CXX_COMPILER="${CXX:-c++}" -DCMAKE_BUILD_TYPE="$build_type" \
  -DSTRATA_SANITIZE="$mode" -DSTRATA_ENABLE_CUDA=OFF "${configure[@]}"

# The tests each pass selects; an empty pass is dropped.
declare -A pass_tests
total=0
for p in "${passes[@]}"; do
  IFS=';' read -r -a fields <<<"$p"
  names=$(ctest --test-dir "$build" -N "${fields[@]:1}" "$@" |
          sed -nE 's/^ *Test +#[0-9]+: (.+)$/\1/p')
  pass_tests[$p]=$names
  [ -n "$names" ] && total=$((total + $(wc -l <<<"$names")))
done
if ((total == 0)); then
  echo "sanitize: no test matches (extra ctest arguments: $*)" >&2
  exit 1
fi

# Build only the executables the selected tests run: each quoted word of a selected test's
# add_test() line (ctest -N shows no command before the build) that names a file in the build
# directory and is also a target.
mapfile -t testfiles < <(find "$build" -name CTestTestfile.cmake)
known=$(cmake --build "$build" --target help | sed -nE 's/^(\.\.\. )?([^: ]+)(: .*)?$/\2/p')
targets=()
for p in "${passes[@]}"; do
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    while IFS= read -r word; do
      case "$word" in
      "$build"/*) ;;
      *) continue ;;
      esac
      target=$(basename "$word")
      if grep -qxF "$target" <<<"$known" && [[ " ${targets[*]} " != *" $target "* ]]; then
        targets+=("$target")
      fi
    done < <(grep -hF "add_test([=[$name]=]" "${testfiles[@]}" | grep -oE '"[^"]*"' | tr -d '"')
  done <<<"${pass_tests[$p]}"
done
if ((${#targets[@]})); then
  run cmake --build "$build" -j 2 --target "${targets[@]}"
else
  echo "sanitize: the selected tests run no executable of this build; nothing to build"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
for p in "${passes[@]}"; do
  [ -n "${pass_tests[$p]}" ] || continue
  IFS=';' read -r -a fields <<<"$p"
  echo "sanitize: LSAN_OPTIONS=${fields[0]}"
  set +e
  LSAN_OPTIONS=${fields[0]} run ctest --test-dir "$build" --output-on-failure "${fields[@]:1}" \
    "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "sanitize: $mode: ctest failed ($rc)"
    status=1
  fi
done
if grep -qE 'No tests were found' "$log"; then
  echo "sanitize: $mode: ctest found no tests"
  status=1
fi
if grep -qE 'The following tests did not run:|\*\*\*Skipped|Not Run' "$log"; then
  echo "sanitize: $mode: a test was skipped or did not run; every selected test must run"
  status=1
fi
if ((status == 0)); then
  echo "sanitize: $mode: every selected test passed ($total)"
fi
exit "$status"
