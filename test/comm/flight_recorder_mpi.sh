#!/usr/bin/env bash
# The flight recorder under mpirun: runs test/comm/flight_recorder_mpi_main.cpp's job (rank 0
# issues an all_reduce #4 that rank 1 never issues), which must end by the watchdog's timeout
# with every process's dump written and named in the message; then strata_flight must name
# collective #4 and rank [1], and its report must hold the all_reduces.
# usage: flight_recorder_mpi.sh <strata_flight> <mpirun command...>
set -u
tool=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "flight_recorder_mpi: $*"
  exit 1
}
STRATA_FLIGHT_RECORDER_DIR=$dir STRATA_COMM_TIMEOUT=1 timeout --kill-after=5 60 "$@" \
  >"$dir/job.txt" 2>&1
rc=$?
cat "$dir/job.txt"
[ "$rc" -ne 0 ] || fail "the job exited 0 but should have timed out"
[ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || fail "the job did not end within 60 s"
grep -qE "^\[strata rank 0\] strata: all_reduce\(count 10, f32, sum\) #4 .*timed out.*flight recorder: dumped to $dir/strata_flight_rank0.json" \
  "$dir/job.txt" || fail "rank 0's timeout message does not name its dump"
for r in 0 1; do
  [ -s "$dir/strata_flight_rank$r.json" ] || fail "no dump from rank $r in $dir"
done
"$tool" analyse "$dir" >"$dir/analysis.txt" 2>&1
rc=$?
cat "$dir/analysis.txt"
[ "$rc" -eq 3 ] || fail "strata_flight analyse exited $rc, expected 3 (a divergence)"
grep -qF "collective #4 all_reduce(count 10, f32, sum) was issued by rank [0] (started) and never issued by rank [1]" \
  "$dir/analysis.txt" || fail "the analysis does not name collective #4 and rank [1]"
grep -qF "rank 1 (world 1): never issued #4; its last collective here was #3" "$dir/analysis.txt" ||
  fail "the analysis does not give rank 1's last collective"
"$tool" report "$dir" --csv "$dir/report.csv" --json "$dir/report.json" ||
  fail "strata_flight report failed"
cat "$dir/report.csv"
# rank, comm 1, 2 ranks, all_reduce, bucket 64: rank 1 completed 3 (2 blocking, 1 not).
grep -qE "^1,1,2,all_reduce,64,3,120,3," "$dir/report.csv" || fail "no row of rank 1's 3 all_reduces"
grep -qE "^0,1,2,send,64,1,40,1," "$dir/report.csv" || fail "no row of rank 0's send"
echo "flight_recorder_mpi: passed"
