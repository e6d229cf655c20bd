#!/usr/bin/env bash
# Runs benchmark binaries alternately and compares them (scripts/bench_ab.py):
#   scripts/bench_ab.sh OUT_DIR ROUNDS FILTER NAME=BINARY [NAME=BINARY ...]
# Each round runs every binary once, in the order given, with --benchmark_filter=FILTER and writes
# OUT_DIR/NAME.ROUND.json; the comparison (the first binary is the baseline) is printed and saved
# as OUT_DIR/ab.txt, after a line per binary with the start of its SHA-256. Alternating in one
# session puts the machine's drift on every build alike.
set -euo pipefail
if (($# < 5)); then
  sed -n '2,7p' "$0" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
out=$1
rounds=$2
filter=$3
shift 3
mkdir -p "$out"
for ((r = 1; r <= rounds; ++r)); do
  for build in "$@"; do
    name=${build%%=*}
    "${build#*=}" --benchmark_filter="$filter" --benchmark_out="$out/$name.$r.json" \
      --benchmark_out_format=json >/dev/null
  done
done
args=()
for build in "$@"; do
  name=${build%%=*}
  files=""
  for ((r = 1; r <= rounds; ++r)); do
    files+="${files:+,}$out/$name.$r.json"
  done
  args+=("$name=$files")
done
# Which binary each name ran (a comparison is only as good as knowing what it compared).
for build in "$@"; do
  echo "# ${build%%=*}: $(sha256sum "${build#*=}" | cut -c1-16) ${build#*=}"
done >"$out/ab.txt"
python3 "$here/bench_ab.py" "${args[@]}" | tee -a "$out/ab.txt"
