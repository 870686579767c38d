#!/usr/bin/env bash
# The main job on a machine with no GPU and no download beyond Debian and npm packages: install
# what is needed, build, and generate text with the bundled tiny Qwen3-MoE checkpoint.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target moe-cli
build/release/moe-cli info -m models/tiny-qwen3-moe
build/release/moe-cli generate -m models/tiny-qwen3-moe -p "${1:-Mixture-of-Experts models are}" -n 32
