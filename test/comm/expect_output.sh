#!/usr/bin/env bash
# Runs a command that must fail, within a deadline, and checks its combined output.
# usage: expect_output.sh SECONDS 'N:extended-regex' ... -- command [args...]
# Each 'N:regex' needs at least N matching lines. Exits non-zero, saying why, otherwise.
set -u
deadline=$1
shift
expects=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  expects+=("$1")
  shift
done
shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
timeout --kill-after=5 "$deadline" "$@" >"$out" 2>&1
rc=$?
cat "$out"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "expect_output: the command did not end within $deadline s"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "expect_output: the command exited 0 but was expected to fail"
  exit 1
fi
status=0
for e in "${expects[@]}"; do
  need=${e%%:*}
  re=${e#*:}
  got=$(grep -cE -- "$re" "$out")
  if [ "$got" -lt "$need" ]; then
    echo "expect_output: expected at least $need line(s) matching '$re', found $got"
    status=1
  fi
done
[ "$status" -eq 0 ] && echo "expect_output: exit code $rc; every expected line found"
exit "$status"
