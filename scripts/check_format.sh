#!/usr/bin/env bash
# Fails when a source file differs from what the project's .clang-format makes of it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang-format
fi
git ls-files -- '*.hpp' '*.cpp' '*.cuh' '*.cu' | xargs clang-format --dry-run --Werror
echo "format check: $(git ls-files -- '*.hpp' '*.cpp' '*.cuh' '*.cu' | wc -l) files clean"
