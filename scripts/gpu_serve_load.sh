#!/usr/bin/env bash
# The GPU serving load test: moe-server --device cuda with a full-size random-weight preset, then
# scripts/serve_load.py at concurrency 32 and 1, then /metrics; logs and results in $OUT.
#   scripts/gpu_serve_load.sh BIN_DIR TOKENIZER_JSON [PRESET=qwen3-30b-a3b]
#   SERVER_FLAGS="--tp 2 --ep 2" scripts/gpu_serve_load.sh ...     more moe-server flags (several GPUs)
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$1 TOK=$2 PRESET=${3:-qwen3-30b-a3b}
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
port=18600
"$BIN/moe-server" -m "presets/$PRESET" --random-weights --device cuda --tokenizer "$TOK" \
  --port $port --max-batch 32 --ctx 1024 --max-step-tokens 512 ${SERVER_FLAGS:-} > "$OUT/server.log" 2>&1 &
pid=$!
python3 - "$port" <<'PY' || { echo "server did not come up"; tail -5 "$OUT/server.log"; kill $pid; exit 1; }
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2); sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
PY
url=http://127.0.0.1:$port
python3 scripts/serve_load.py $url 128 32 64 | tee "$OUT/load_c32.txt"
python3 scripts/serve_load.py $url 16 1 64 | tee "$OUT/load_c1.txt"
python3 -c "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1] + '/metrics').read().decode())" $url > "$OUT/metrics.txt"
grep -E "^moe_(requests_total|generated_tokens_total|kv_blocks_in_use|preemptions)" "$OUT/metrics.txt"
kill -TERM $pid; wait $pid; echo "server exit $?"
head -3 "$OUT/server.log"
