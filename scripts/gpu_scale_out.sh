#!/usr/bin/env bash
# DeepSeek-V3 in FP8 (random weights, its real config) over the GPUs of one machine, in as few
# commands as a lease allows: expert parallelism over all of them with data-parallel attention
# and with tensor-parallel attention, every EP backend, the step op by op, and the server at
# concurrency 64 with 2,048-token prompts. Logs in $OUT (default ./gpu-results/scale_out), one
# per run, each beginning with its command; summary.txt lists each run's exit status.
#
#   scripts/gpu_scale_out.sh BIN_DIR            BIN_DIR holds moe-bench and moe-server
#   GPUS=4 LAYERS=4 scripts/gpu_scale_out.sh ... the real config with 4 layers (the first dense)
#                                                on 4 GPUs, where the whole model does not fit
#   STEPS="model backends" scripts/gpu_scale_out.sh ...   some steps (default: all four)
#   STEPS=backends BACKENDS="p2p alltoall_packed" ...     some EP backends (default: all five)
#
# Steps (each fits one 10-minute command on eight H200s by the memory plan in docs/scale_out.md;
# run them as separate commands where the lease limits a command's time):
#   model     --ep G with --dp G and with --tp G (p2p exchange): decode at batch 1, 64 and 256
#             against the floor, a 2,048-token prefill, and the memory per GPU (also as JSON)
#   backends  every EP backend at batch 1 and 256, under --dp G and --tp G
#   profile   one decode step op by op under --tp G at batch 1 and 256 (a profile under --dp
#             would record one group's routing only, which moe-bench refuses)
#   serve     moe-server --ep G --dp G at concurrency 64, 2,048-token prompts, 1,024 output
#             tokens (scripts/gpu_serve_load.sh; Qwen3's tokenizer stands in, see there)
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:?usage: scripts/gpu_scale_out.sh BIN_DIR}
GPUS=${GPUS:-8}
LAYERS=${LAYERS:-}
STEPS=${STEPS:-model backends profile serve}
OUT=${OUT:-$PWD/gpu-results/scale_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
[ -x "$BIN/moe-bench" ] || { echo "no moe-bench in $BIN"; exit 2; }

# The model: the preset, or a copy of its config with LAYERS layers (the first of them dense).
MODEL=presets/deepseek-v3
if [ -n "$LAYERS" ]; then
  MODEL="$OUT/deepseek-v3-$LAYERS-layers"
  mkdir -p "$MODEL"
  python3 - presets/deepseek-v3/config.json "$MODEL/config.json" "$LAYERS" <<'PY' || exit 2
import json, sys
c = json.load(open(sys.argv[1]))
layers = int(sys.argv[3])
if layers < 2:
    sys.exit("LAYERS must be at least 2 (one dense layer, one of experts)")
c["num_hidden_layers"] = layers
c["first_k_dense_replace"] = 1
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
fi

nvidia-smi > "$OUT/device.txt" 2>&1 || echo "nvidia-smi failed" > "$OUT/device.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
date -u +%FT%TZ > "$OUT/date.txt"
: > "$OUT/summary.txt"
status=0
bench() {  # bench NAME ARGS...: one moe-bench model run, its output in $OUT/NAME.txt
  local name=$1; shift
  local cmd=("$BIN/moe-bench" model --device cuda -m "$MODEL" --random-weights --input-len 128 --output-len 32 "$@")
  echo "== $name: ${cmd[*]}"
  local t0=$SECONDS
  { echo "# ${cmd[*]}"; "${cmd[@]}"; } > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  grep -E "^(batch|prefill)|fullest|error" "$OUT/$name.txt"
}

for step in $STEPS; do
  case $step in
    model)
      for split in dp tp; do
        bench "model_${split}${GPUS}" --ep "$GPUS" --$split "$GPUS" --ep-backend p2p --batches 1,64,256 --prefill-len 2048
        bench "model_${split}${GPUS}_json" --ep "$GPUS" --$split "$GPUS" --ep-backend p2p --batches 1 --json
      done ;;
    backends)
      for backend in ${BACKENDS:-p2p local_allreduce allgather_reducescatter alltoall_padded alltoall_packed}; do
        # local_allreduce runs every rank's experts on every token: no data-parallel attention.
        [ $backend = local_allreduce ] || bench "backend_dp${GPUS}_$backend" --ep "$GPUS" --dp "$GPUS" --ep-backend $backend --batches 1,256
        bench "backend_tp${GPUS}_$backend" --ep "$GPUS" --tp "$GPUS" --ep-backend $backend --batches 1,256
      done ;;
    profile)
      for backend in p2p local_allreduce; do
        bench "profile_tp${GPUS}_$backend" --ep "$GPUS" --tp "$GPUS" --ep-backend $backend --batches 1,256 --profile
      done ;;
    serve)
      [ -x "$BIN/moe-server" ] || { echo "no moe-server in $BIN"; status=1; continue; }
      echo "== serve: --ep $GPUS --dp $GPUS, concurrency 64"
      t0=$SECONDS
      OUT="$OUT/serve" WORKLOAD=random2048 CONCURRENCY=64 REQUESTS=${REQUESTS:-128} \
        SERVER_FLAGS="--ep $GPUS --dp $GPUS --ep-backend p2p" \
        scripts/gpu_serve_load.sh "$BIN" presets/qwen3-30b-a3b/tokenizer.json "$MODEL" > "$OUT/serve.txt" 2>&1
      rc=$?
      echo "serve: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
      [ $rc -eq 0 ] || status=1
      tail -n 20 "$OUT/serve.txt" ;;
    *) echo "unknown step '$step' (model, backends, profile, serve)"; status=1 ;;
  esac
done
exit $status
