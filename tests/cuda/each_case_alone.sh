#!/usr/bin/env bash
# Runs each GPU test case that TAG selects in a process of its own, so that a case's first launch
# of each kernel is the first in its process (and the launchers' once-per-device set-up runs in
# whatever the case does first, such as a stream capture). Exits 77 (ctest's SKIP_RETURN_CODE)
# where the binary finds no GPU, 1 where a case fails or TAG selects none.
#   tests/cuda/each_case_alone.sh TEST_BINARY TAG
set -uo pipefail
bin=$1
tag=$2
listing=$("$bin" --list-test-names-only "$tag")
if [[ $? -eq 77 ]]; then
  echo "$listing"
  exit 77
fi
# The binary's first line names the GPU; the case names follow, one a line.
mapfile -t names < <(grep -v -e '^GPU tests on ' -e '^$' <<<"$listing")
if [[ ${#names[@]} -eq 0 ]]; then
  echo "no test case tagged $tag"
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
for name in "${names[@]}"; do
  # The name with a backslash before each character a test spec reads as syntax (a comma would
  # make it a list of names, brackets a tag, an asterisk a wildcard).
  # shellcheck disable=SC2001 # one backslash before each of a set of characters
  "$bin" "$(sed 's/[][\\,*]/\\&/g' <<<"$name")" -w NoTests >"$log" 2>&1
  case_rc=$?
  passed=$(grep -E '^All tests passed' "$log")
  echo "$name: exit $case_rc; ${passed:-$(grep -E '^(test cases:|No tests ran)' "$log")}"
  if [[ $case_rc -ne 0 || -z $passed ]]; then
    cat "$log"
    rc=1
  fi
done
exit "$rc"
