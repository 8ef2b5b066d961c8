#!/usr/bin/env bash
# The GPU path's rule test: what must never appear in a step, grepped in the device paths.
#
# usage: check_rules.sh ROOT [ALLOW_LIST]
#   ROOT        the source tree (the repository, or a fixture tree shaped like it)
#   ALLOW_LIST  the exact places a rule is allowed (default: ROOT/test/gpu/rules/allow.txt)
#
# Device paths: include/strata/core/cuda/, include/strata/*/kernels/, include/strata/comm/nccl/,
# include/strata/nn/device/ (the device twins), include/strata/train/device_trainer.hpp (the
# device engine), every *.cuh under include/ (the launchers), bench/gpu/. In them, after
# comments and string literals are removed from each line:
#   host_sync      cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize: the host
#                  waits only through cuda_context::synchronize (counted)
#   sync_copy      synchronous cudaMemcpy( / cudaMemset( (and their 2D/3D/symbol/peer forms);
#                  the *Async forms on a stream are what a step uses
#   thrust         Thrust calls that return to the host or allocate (reduce, count, find, ...,
#                  device_vector, host_vector) and the synchronous policies thrust::device,
#                  thrust::cuda::par
#   alloc          cudaMalloc / cudaFree and their pinned, pitched and async forms: memory is
#                  allocated while the program is built, never in a step
#   managed        managed memory (cudaMallocManaged, __managed__)
#   atomic         atomicAdd: float atomics make a reduction's result depend on timing; an
#                  integer one needs an allow-list entry saying why
#   cublaslt_plan  cuBLASLt descriptor, layout, preference and heuristic calls: once, in the gemm
#                  plan's build
# And in every CMake file of ROOT (CMakeLists.txt, *.cmake; build trees and the fixture left
# out), comments removed:
#   fast_math      nvcc's fast-math flag (approximate division, square root and exp; flushes
#                  denormals): the device would no longer match the host
#
# The allow list's lines are `rule|file|region|reason`: file relative to ROOT; region an ERE for
# the first line of the enclosing function (the allowed region runs to the closing brace at that
# line's indentation), or * for the whole file. An entry that allows nothing is an error too (the
# list names exact places). Prints each violation as file:line: [rule] what, then a summary;
# exits 1 when there is a violation or a stale entry, 0 otherwise.
set -euo pipefail

root=${1:?usage: check_rules.sh ROOT [ALLOW_LIST]}
root=$(cd "$root" && pwd)
allow=${2:-$root/test/gpu/rules/allow.txt}
[ -f "$allow" ] || {
  echo "check_rules: no allow list at $allow"
  exit 2
}

mapfile -t code_files < <(
  {
    for d in include/strata/core/cuda include/strata/comm/nccl include/strata/nn/device bench/gpu; do
      [ -d "$root/$d" ] && find "$root/$d" -type f \( -name '*.hpp' -o -name '*.h' -o -name '*.cuh' \
        -o -name '*.cu' -o -name '*.cpp' \) -print
    done
    for d in "$root"/include/strata/*/kernels; do
      [ -d "$d" ] && find "$d" -type f \( -name '*.hpp' -o -name '*.cuh' -o -name '*.cu' \) -print
    done
    [ -f "$root/include/strata/train/device_trainer.hpp" ] &&
      echo "$root/include/strata/train/device_trainer.hpp"
    [ -d "$root/include" ] && find "$root/include" -type f -name '*.cuh' -print
  } | sort -u
)
mapfile -t cmake_files < <(find "$root" -type d \( -name .git -o -name 'build*' \
  -o -path "$root/test/gpu/rules/fixture" \) -prune -o -type f \( -name CMakeLists.txt -o -name '*.cmake' \) -print | sort)

# One awk pass: the allow list, then the code files, then the CMake files (told by their names).
awk -v root="$root/" -v allowfile="$allow" '
function rel(path) { return substr(path, 1, length(root)) == root ? substr(path, length(root) + 1) : path }
function indent_of(s,   m) { m = match(s, /[^ ]/); return m == 0 ? length(s) : m - 1 }
function report(rule, what, line) {
  sub(/^[ \t]+/, "", line)
  printf "%s:%d: [%s] %s: %s\n", rel(FILENAME), FNR, rule, what, line
  ++violations
}
BEGIN {
  nrules = 0
  rule[++nrules] = "host_sync"; re[nrules] = "(^|[^A-Za-z0-9_])cuda(Device|Stream|Event|Thread)Synchronize[ \t]*\\("
  what[nrules] = "a host wait outside cuda_context::synchronize (the one counted wait)"
  rule[++nrules] = "sync_copy"; re[nrules] = "(^|[^A-Za-z0-9_])cudaMem(cpy|set)(2D|3D|ToSymbol|FromSymbol|Peer)?[ \t]*\\("
  what[nrules] = "a synchronous copy or memset (copy_async / memset_async on a stream)"
  rule[++nrules] = "thrust"; re[nrules] = "thrust::(reduce|transform_reduce|inner_product|count|count_if|find|find_if|min_element|max_element|minmax_element|all_of|any_of|none_of|equal|device_vector|host_vector|device([^A-Za-z0-9_]|$)|cuda::par([^A-Za-z0-9_]|$))"
  what[nrules] = "Thrust that returns to the host, allocates or runs a synchronous policy"
  rule[++nrules] = "alloc"; re[nrules] = "(^|[^A-Za-z0-9_])cuda(Malloc|MallocAsync|MallocPitch|Malloc3D|MallocArray|MallocHost|HostAlloc|Free|FreeAsync|FreeHost|FreeArray)[ \t]*\\("
  what[nrules] = "memory allocated or freed outside the build-time allocators"
  rule[++nrules] = "managed"; re[nrules] = "cudaMallocManaged|__managed__"
  what[nrules] = "managed memory"
  rule[++nrules] = "atomic"; re[nrules] = "(^|[^A-Za-z0-9_])atomicAdd(_block|_system)?[ \t]*\\("
  what[nrules] = "atomicAdd (a float atomic makes a reduction depend on timing)"
  rule[++nrules] = "cublaslt_plan"; re[nrules] = "(^|[^A-Za-z0-9_])cublasLt(MatmulDescCreate|MatrixLayoutCreate|MatmulPreferenceCreate|MatmulAlgoGetHeuristic)[ \t]*\\("
  what[nrules] = "a cuBLASLt descriptor, layout, preference or heuristic call outside the gemm plan build"
}
FILENAME == allowfile {
  if ($0 ~ /^[ \t]*(#|$)/) next
  n = split($0, f, "|")
  if (n < 4 || f[1] == "" || f[2] == "" || f[3] == "") {
    printf "check_rules: bad allow-list line: %s\n", $0; bad_allow++; next
  }
  na++; a_rule[na] = f[1]; a_file[na] = f[2]; a_region[na] = f[3]; a_used[na] = 0; a_text[na] = $0
  next
}
FNR == 1 {
  files++
  for (i = 1; i <= na; i++) { open_[i] = (a_file[i] == rel(FILENAME) && a_region[i] == "*"); one_line[i] = 0 }
}
# A CMake file.
FILENAME ~ /(CMakeLists\.txt|\.cmake)$/ {
  s = $0
  sub(/#.*$/, "", s)
  if (s ~ /use_fast_math/) report("fast_math", "nvcc fast math (the device would no longer match the host)", $0)
  next
}
{
  line = $0
  s = line
  gsub(/"([^"\\]|\\.)*"/, "\"\"", s)
  sub(/\/\/.*$/, "", s)
  # Allowed regions open on this line: a function from its first line to its closing brace at
  # the same indentation (or its one line).
  for (i = 1; i <= na; i++) {
    if (open_[i] || a_region[i] == "*" || a_file[i] != rel(FILENAME)) continue
    if (s ~ a_region[i]) {
      open_[i] = 1; close_indent[i] = indent_of(line)
      one_line[i] = (s ~ /\{.*\}[ \t]*;?[ \t]*$/)
    }
  }
  for (r = 1; r <= nrules; r++) {
    if (s !~ re[r]) continue
    allowed = 0
    for (i = 1; i <= na; i++)
      if (open_[i] && a_rule[i] == rule[r]) { allowed = 1; a_used[i]++ }
    if (!allowed) report(rule[r], what[r], line)
  }
  for (i = 1; i <= na; i++) {
    if (!open_[i] || a_region[i] == "*") continue
    if (one_line[i] || (s ~ /^[ \t]*\}/ && indent_of(line) == close_indent[i])) { open_[i] = 0; one_line[i] = 0 }
  }
}
END {
  for (i = 1; i <= na; i++)
    if (!a_used[i]) { printf "check_rules: stale allow-list entry (allows nothing): %s\n", a_text[i]; stale++ }
  printf "check_rules: %d file(s), %d violation(s), %d allow-list entr%s (%d stale, %d malformed)\n",
         files, violations, na, na == 1 ? "y" : "ies", stale, bad_allow
  exit (violations || stale || bad_allow) ? 1 : 0
}
' "$allow" "${code_files[@]}" "${cmake_files[@]}"
