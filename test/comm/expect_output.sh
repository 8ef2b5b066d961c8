#!/usr/bin/env bash
# Runs a command within a deadline and checks how it ended and what it printed.
# usage: expect_output.sh fail|pass SECONDS 'N:extended-regex' ... -- command [args...]
# fail: the command must exit non-zero; pass: zero. Each 'N:regex' needs at least N matching
# lines of its combined output. Exits non-zero, saying why, otherwise.
set -u
want=$1
deadline=$2
shift 2
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
if [ "$want" = fail ] && [ "$rc" -eq 0 ]; then
  echo "expect_output: the command exited 0 but was expected to fail"
  exit 1
fi
if [ "$want" = pass ] && [ "$rc" -ne 0 ]; then
  echo "expect_output: the command exited $rc but was expected to succeed"
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
