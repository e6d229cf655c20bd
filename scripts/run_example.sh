#!/usr/bin/env bash
# Sets up, builds and runs kvkit's main example, the serving simulation. Arguments go to it
# (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/configure.sh build/release >/dev/null
cmake --build build/release --parallel "$(nproc)" --target serving_sim
exec build/release/examples/serving_sim "$@"
