#!/usr/bin/env bash
# Installs what kvkit's build, tests and benchmarks need, from Debian packages, when missing.
set -euo pipefail

packages=(cmake ninja-build g++ catch2 libbenchmark-dev libxxhash-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "installing: ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# nvcc is optional: without it the CUDA target, GPU tests and GPU benchmarks are not built.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "note: nvcc found at /usr/local/cuda/bin; add it to PATH to build the CUDA parts"
fi
