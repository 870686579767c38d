#!/usr/bin/env bash
# The main job on a machine with no GPU and no download beyond Debian and npm packages: install
# what is needed, build, generate text with the bundled tiny Qwen3-MoE checkpoint, then run the
# MoE layer benchmark on its default (the seed workload: 64 tokens, hidden 512, intermediate
# 1024, 8 experts, top-2, expert parallelism over 2 ranks).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target moe-cli moe-bench
build/release/moe-cli info -m models/tiny-qwen3-moe
build/release/moe-cli generate -m models/tiny-qwen3-moe -p "${1:-Mixture-of-Experts models are}" -n 32
build/release/moe-bench layer
