#!/usr/bin/env bash
# Configures a build folder: scripts/configure.sh BUILD_DIR [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=$1
shift
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# -O2 with assertions on: fast enough for the property tests, and internal checks stay armed.
cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g" \
  -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O2 -g" \
  "$@"
