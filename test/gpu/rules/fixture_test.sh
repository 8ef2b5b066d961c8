#!/usr/bin/env bash
# The rule test can fail: check_rules.sh on the fixture tree (test/gpu/rules/fixture), whose files
# plant one violation of each rule, must exit 1 and report exactly the places in expected.txt
# (none of the allowed place, the comments or the strings), and the stale allow-list entry.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fixture=$here/fixture
out=$(bash "$here/check_rules.sh" "$fixture" "$fixture/allow.txt" 2>&1)
rc=$?
echo "$out"
status=0
if [ "$rc" -ne 1 ]; then
  echo "fixture_test: check_rules.sh exited $rc on the fixture, expected 1"
  status=1
fi
got=$(echo "$out" | grep -oE '^[^ ]+:[0-9]+: \[[a-z_]+\]' | sort)
want=$(grep -v '^#' "$fixture/expected.txt" | sort)
if [ "$got" != "$want" ]; then
  echo "fixture_test: reported places differ from expected.txt (< expected, > reported):"
  diff <(echo "$want") <(echo "$got")
  status=1
fi
if ! echo "$out" | grep -q 'stale allow-list entry .*void missing'; then
  echo "fixture_test: the stale allow-list entry was not reported"
  status=1
fi
[ "$status" -eq 0 ] && echo "fixture_test: every planted violation reported, nothing else"
exit "$status"
