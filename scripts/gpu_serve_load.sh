#!/usr/bin/env bash
# The GPU serving load test: moe-server --device cuda with a full-size random-weight preset, then
# scripts/serve_load.py, then /metrics; logs and results in $OUT.
#   scripts/gpu_serve_load.sh BIN_DIR TOKENIZER_JSON [PRESET=qwen3-30b-a3b]   (a name under presets/ or a model directory)
#   SERVER_FLAGS="--tp 2 --ep 2" scripts/gpu_serve_load.sh ...     more moe-server flags (several GPUs)
#   WORKLOAD=random2048 [CONCURRENCY=64] scripts/gpu_serve_load.sh ...
# The default workload is 128 mixed-length word prompts, 64 tokens each, at concurrency 32, then
# 16 at concurrency 1. random2048 is the serving benchmark's: REQUESTS (40) prompts of 2,048
# random token ids (below VOCAB, see there), 1,024 output tokens each (EOS ignored),
# CONCURRENCY (10) in flight, with room for at least 16 sequences.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$1 TOK=$2 PRESET=${3:-qwen3-30b-a3b}
MODEL=presets/$PRESET
[ -d "$PRESET" ] && MODEL=$PRESET
OUT=${OUT:-$PWD/gpu-results}
WORKLOAD=${WORKLOAD:-mixed}
mkdir -p "$OUT"
port=18600
CONCURRENCY=${CONCURRENCY:-10}
# The prompts' token ids: below Qwen3's special tokens (151,643, serve_load.py's default) or the
# preset's vocab_size where that is smaller, so that the tokenizer of a model with a larger
# vocabulary can stand in for a preset that has none (DeepSeek-V3's 129,280 ids under Qwen3's
# tokenizer; the output text then means nothing, the throughput is the model's).
model_vocab=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json") ||
  { echo "no vocab_size in $MODEL/config.json"; exit 2; }
VOCAB=${VOCAB:-$((model_vocab < 151643 ? model_vocab : 151643))}
case $WORKLOAD in
  mixed) flags="--max-batch 32 --ctx 1024 --max-step-tokens 512" ;;
  random2048) flags="--max-batch $((CONCURRENCY > 16 ? CONCURRENCY : 16)) --ctx 3072 --max-step-tokens 2048" ;;
  *) echo "unknown WORKLOAD '$WORKLOAD' (mixed or random2048)"; exit 2 ;;
esac
"$BIN/moe-server" -m "$MODEL" --random-weights --device cuda --tokenizer "$TOK" \
  --port $port $flags ${SERVER_FLAGS:-} > "$OUT/server.log" 2>&1 &
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
load=0  # the load test's status: the script's own at the end (pipefail carries it through tee)
if [ "$WORKLOAD" = mixed ]; then
  python3 scripts/serve_load.py $url 128 32 64 | tee "$OUT/load_c32.txt" || load=1
  python3 scripts/serve_load.py $url 16 1 64 | tee "$OUT/load_c1.txt" || load=1
else
  python3 scripts/serve_load.py $url "${REQUESTS:-40}" "$CONCURRENCY" 1024 0 --prompt-ids 2048 --vocab "$VOCAB" |
    tee "$OUT/load_random2048.txt" || load=1
fi
python3 -c "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1] + '/metrics').read().decode())" $url > "$OUT/metrics.txt"
grep -E "^moe_(requests_total|generated_tokens_total|kv_blocks_in_use|preemptions)" "$OUT/metrics.txt"
kill -TERM $pid; wait $pid; echo "server exit $?"
head -3 "$OUT/server.log"
exit $load
