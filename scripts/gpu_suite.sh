#!/usr/bin/env bash
# The GPU suite in one command, on a machine with a CUDA device: the GPU tests (ops, attention,
# experts, whole models), compute-sanitizer memcheck and racecheck on the op tests, and the
# benchmarks. Every log and JSON result lands in $OUT (default ./gpu-results), with summary.txt
# listing each step's exit status.
#
#   scripts/gpu_suite.sh [BIN_DIR]      BIN_DIR holds moe-tests, moe-bench (default build/release)
#   STEPS="tests sanitize bench" scripts/gpu_suite.sh    choose steps (default: all three)
#
# The binaries may be built on another machine (the GPU machine needs only the CUDA driver and
# libcublasLt): the tests find their fixtures through the source path compiled into them, so run
# this from a checkout, which is linked to that path (MOE_BUILT_AT) when it differs.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build/release}
OUT=${OUT:-$PWD/gpu-results}
STEPS=${STEPS:-tests sanitize bench}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0

# libcublasLt and libnccl (opened at run time by the NCCL communicator) from the toolkit, or
# from the wheels PyTorch ships with.
for d in /usr/local/cuda/lib64 \
         "$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)" \
         "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + "/lib")' 2>/dev/null)"; do
  [ -n "$d" ] && [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done

# MOE_BUILT_AT: the checkout path the binaries were compiled in (their fixture paths).
src=${MOE_BUILT_AT:-/work/main}
if [ "$src" != "$PWD" ] && [ ! -e "$src/tests/fixtures" ]; then
  mkdir -p "$(dirname "$src")" && ln -sfn "$PWD" "$src"
fi

nvidia-smi > "$OUT/device.txt" 2>&1 || echo "nvidia-smi failed" > "$OUT/device.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
date -u +%FT%TZ > "$OUT/date.txt"
: > "$OUT/summary.txt"
status=0
step() {  # step NAME COMMAND...: runs it, keeps its output, records its exit status
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  tail -n 3 "$OUT/$name.log"
}

GPU_TESTS='Cuda*:*/Cuda*:Nccl*:*PeerAllReduce*:GpuScheduler*'
# The op tests under the sanitizers (the timing tests only print; they are left out).
OP_TESTS='CudaOps*:CudaRoute*:CudaNormRoute*:CudaSample*:CudaAttention*:CudaLatent*:CudaMoe*:CudaBlas*:*PeerAllReduce*:-*Timing*'
for s in $STEPS; do
  case $s in
    tests)
      step gpu_tests "$BIN/moe-tests" --gtest_filter="$GPU_TESTS" ;;
    sanitize)
      step memcheck compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
        "$BIN/moe-tests" --gtest_filter="$OP_TESTS"
      step racecheck compute-sanitizer --tool racecheck --error-exitcode 9 \
        "$BIN/moe-tests" --gtest_filter="$OP_TESTS" ;;
    bench)
      for p in qwen3-30b-a3b deepseek-v2-lite; do
        step "layer_$p" "$BIN/moe-bench" layer --device cuda --preset "$p" --json
        cp "$OUT/layer_$p.log" "$OUT/layer_$p.json"
      done
      for p in qwen3-30b-a3b deepseek-v2-lite; do
        step "model_$p" "$BIN/moe-bench" model --device cuda --preset "$p" --random-weights \
          --batches 1,8,64 --input-len 128 --output-len 64 --prefill-len 2048 --profile --json
      done
      # Expert parallelism over the machine's GPUs: the seed workload (no arguments: two GPUs)
      # and the qwen3 layer, every mode.
      gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
      if [ "$gpus" -ge 2 ]; then
        step layer_seed_ep2 "$BIN/moe-bench" layer --json
        # The whole model on two GPUs (tensor-parallel attention, grouped-query and latent, half
        # the experts each).
        for p in qwen3-30b-a3b deepseek-v2-lite; do
          step "model_${p}_tp2ep2" "$BIN/moe-bench" model --device cuda --preset "$p" \
            --random-weights --batches 1,8,64 --input-len 128 --output-len 64 --prefill-len 2048 \
            --tp 2 --ep 2 --profile --json
        done
        for n in 2 4 8; do
          [ "$gpus" -ge $n ] || continue
          step "layer_qwen3-30b-a3b_ep$n" "$BIN/moe-bench" layer --preset qwen3-30b-a3b --ep $n \
            --runs 10 --warmup 2 --json
        done
      fi ;;
    *) echo "unknown step '$s' (tests, sanitize, bench)"; exit 2 ;;
  esac
done
echo "results in $OUT"
exit $status
