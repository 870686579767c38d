#!/usr/bin/env bash
# Bad input through moe-cli: each case must exit non-zero (not by a signal) and print exactly one
# line, starting with "error:", that names the problem.
set -u
cli=${MOE_CLI:?path to moe-cli}
src=${MOE_SOURCE_DIR:?repository root}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fixture="$src/tests/fixtures/qwen3_moe_f32"
failures=0
passed=0

# expect NAME PATTERN -- command...: the command must fail with one "error:" line matching PATTERN.
expect() {
  local name=$1 pattern=$2
  shift 3
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  local lines
  lines=$(printf '%s' "$err" | grep -c '')
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ]; then
    echo "FAIL $name: exit code $rc (want 1..127)"; failures=$((failures + 1)); return
  fi
  if [ "$lines" -ne 1 ] || [[ "$err" != error:* ]] || ! grep -qE -- "$pattern" <<<"$err"; then
    echo "FAIL $name: stderr was: $err"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $err"
  passed=$((passed + 1))
}

# A model directory that is a copy of the fixture, to be damaged by each case.
fresh() { rm -rf "$work/m"; cp -r "$fixture" "$work/m"; }
# Writes a safetensors file made of the given header text and N zero bytes of data.
write_st() {
  local file=$1 header=$2 data_bytes=$3 len=${#2}
  printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' $((len & 255)) $(((len >> 8) & 255)) $(((len >> 16) & 255)) $(((len >> 24) & 255)))" >"$file"
  printf '%s' "$header" >>"$file"
  head -c "$data_bytes" /dev/zero >>"$file"
}

expect missing_dir "does not exist" -- "$cli" logits -m "$work/nope" --ids 1
fresh; rm "$work/m/config.json"
expect missing_config "config.json" -- "$cli" logits -m "$work/m" --ids 1
fresh; rm "$work/m/model.safetensors"
expect missing_weights "model.safetensors" -- "$cli" logits -m "$work/m" --ids 1
fresh; head -c 3 "$fixture/model.safetensors" >"$work/m/model.safetensors"
expect truncated_header "truncated" -- "$cli" logits -m "$work/m" --ids 1
fresh; head -c 100000 "$fixture/model.safetensors" >"$work/m/model.safetensors"
expect truncated_data "past the end" -- "$cli" logits -m "$work/m" --ids 1
fresh; printf '\xff\xff\xff\x00\x00\x00\x00\x00{}' >"$work/m/model.safetensors"
expect header_larger_than_file "larger than the file" -- "$cli" logits -m "$work/m" --ids 1
fresh; write_st "$work/m/model.safetensors" '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12
expect overlapping_offsets "overlap" -- "$cli" logits -m "$work/m" --ids 1
fresh; write_st "$work/m/model.safetensors" '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' 8
expect offsets_out_of_range "past the end" -- "$cli" logits -m "$work/m" --ids 1
fresh; write_st "$work/m/model.safetensors" '{"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}}' 8
expect unknown_dtype "Q4_K" -- "$cli" logits -m "$work/m" --ids 1
fresh; sed -i 's/"moe_intermediate_size": 32/"moe_intermediate_size": 48/' "$work/m/config.json"
expect wrong_shape "gate_proj.weight' has shape" -- "$cli" logits -m "$work/m" --ids 1
fresh; sed -i 's/Qwen3MoeForCausalLM/BertForMaskedLM/' "$work/m/config.json"
expect unknown_architecture "unknown architecture 'BertForMaskedLM'" -- "$cli" logits -m "$work/m" --ids 1
fresh; sed -i 's/^{/{ broken/' "$work/m/config.json"
expect malformed_config "not valid JSON" -- "$cli" info -m "$work/m"
# FP8 block-scaled checkpoints (DeepSeek-V3's layout), damaged one way each. fp8_edit CODE runs
# CODE over the copy's safetensors header `h` (a dict) and data `d` (a bytearray) and writes it back.
fp8="$src/tests/fixtures/deepseek_v3_fp8"
fp8_fresh() { rm -rf "$work/f"; cp -r "$fp8" "$work/f"; }
fp8_edit() {
  python3 - "$work/f/model.safetensors" "$1" <<'PY'
import json, struct, sys
path, code = sys.argv[1], sys.argv[2]
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h, d = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
exec(code)
text = json.dumps(h).encode()
open(path, "wb").write(struct.pack("<Q", len(text)) + text + bytes(d))
PY
}
w=model.layers.0.self_attn.q_a_proj.weight
fp8_fresh; fp8_edit "del h['$w""_scale_inv']"
expect fp8_missing_scale "FP8 tensor '$w' has no scale tensor '$w""_scale_inv'" -- "$cli" logits -m "$work/f" --ids 1
w2=model.layers.0.self_attn.q_b_proj.weight  # [192, 128]: scales [2, 1]
fp8_fresh; fp8_edit "h['$w2""_scale_inv']['shape'] = [1, 2]"
expect fp8_scale_shape "scale '$w2""_scale_inv' has shape \[1, 2\], but $w2 \[192, 128\] in 128 x 128 blocks needs \[2, 1\]" -- "$cli" logits -m "$work/f" --ids 1
fp8_fresh; fp8_edit "a = h['$w""_scale_inv']['data_offsets'][0]; d[a:a + 4] = struct.pack('<f', float('nan'))"
expect fp8_nonfinite_scale "scale '$w""_scale_inv' holds nan at block \[0, 0\]" -- "$cli" logits -m "$work/f" --ids 1
fp8_fresh; fp8_edit "h['$w']['dtype'] = 'F8_E5M2'"
expect fp8_e5m2_declared_e4m3 "tensor '$w' is F8_E5M2, but quantization_config declares e4m3" -- "$cli" logits -m "$work/f" --ids 1
fp8_fresh; sed -i 's/^      128,$/      64,/' "$work/f/config.json"
expect fp8_block_size "weight_block_size \[64, 128\] is not a block the engine runs" -- "$cli" logits -m "$work/f" --ids 1
fp8_fresh; python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); del c['quantization_config']; json.dump(c, open(p,'w'))" "$work/f/config.json"
expect fp8_undeclared "is f8_e4m3 but config.json declares no FP8 quantization_config" -- "$cli" logits -m "$work/f" --ids 1
fp8_fresh; sed -i 's/"quant_method": "fp8"/"quant_method": "awq"/' "$work/f/config.json"
expect quant_method_unsupported "quant_method 'awq' is not supported; supported: quant_method fp8" -- "$cli" info -m "$work/f"

expect token_id_out_of_vocab "token id 384 is outside the vocabulary" -- "$cli" logits -m "$fixture" --ids 3,384
expect negative_token_id "token id -2" -- "$cli" logits -m "$fixture" --ids -2
expect not_a_token_id "'x' is not a token id" -- "$cli" logits -m "$fixture" --ids 3,x
expect empty_ids "empty prompt" -- "$cli" logits -m "$fixture" --ids ""
expect empty_prompt "empty prompt" -- "$cli" generate -m "$src/models/tiny-qwen3-moe" -p ""
expect no_tokenizer "no tokenizer" -- "$cli" generate -m "$fixture" -p "hi"
expect bad_temperature "temperature" -- "$cli" generate -m "$src/models/tiny-qwen3-moe" -p "hi" --temp -1
expect bad_top_p "top-p" -- "$cli" generate -m "$src/models/tiny-qwen3-moe" -p "hi" --top-p 1.5
expect detokenize_out_of_vocab "999999" -- "$cli" detokenize -m "$src/models/tiny-qwen3-moe" --ids 999999
expect context_too_long "exceed the context" -- "$cli" generate -m "$src/models/tiny-qwen3-moe" -p "hi there" -n 10 --ctx 4

expect unknown_ep_backend "valid names: local_allreduce" -- "$cli" logits -m "$fixture" --ids 1 --ep 2 --ep-backend fastest
expect gpu_only_ep_backend "p2p" -- "$cli" logits -m "$fixture" --ids 1 --ep 2 --ep-backend p2p
expect ep_larger_than_experts "larger than the number of experts" -- "$cli" logits -m "$fixture" --ids 1 --ep 9
expect bad_exec_mode "valid: naive, grouped" -- "$cli" logits -m "$fixture" --ids 1 --exec fastest
expect bad_device "--device tpu: expected cpu or cuda" -- "$cli" logits -m "$fixture" --ids 1 --device tpu
expect tp_on_cpu "--tp 2: tensor-parallel attention runs on GPUs only" -- "$cli" logits -m "$fixture" --ids 1 --tp 2
expect cuda_tp_without_ep "runs over the expert-parallel GPUs|no CUDA backend" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --tp 2
expect cuda_ep_backend_one_gpu "--ep-backend p2p exchanges tokens between GPUs: it needs --ep 2 or more|no CUDA backend" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep-backend p2p
expect cuda_ep_backend_not_built "--ep-backend deepep: this build has no DeepEP kernels" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 2 --ep-backend deepep
expect cuda_unknown_ep_backend "valid names: local_allreduce" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 2 --ep-backend fastest
expect dp_on_cpu "--dp 2: data-parallel attention runs on GPUs only" -- "$cli" logits -m "$fixture" --ids 1 --dp 2
expect cuda_dp_through_allreduce "use allgather_reducescatter, alltoall_padded, alltoall_packed or p2p" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 2 --dp 2
expect cuda_dp_not_every_gpu "must equal the GPUs, which --ep sets" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 4 --dp 2 --ep-backend p2p
expect cuda_dp_groups_not_every_gpu "--dp 2 --tp 2 --ep 2: dp × tp must equal the GPUs" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 2 --tp 2 --dp 2 --ep-backend alltoall_packed
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect cuda_ep_needs_gpus "needs 2 GPUs from device 0; this machine has 0|no CUDA backend" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --ep 2
fi
expect cuda_with_expert_stats "--expert-stats is CPU-only" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --expert-stats
# The argument parser's own errors read as every other: one "error:" line.
expect cli_threads_without_a_model "not expected: .*--threads" -- "$cli" tokenize -m "$fixture" --text hi --threads 2
expect cli_missing_ids "--ids is required" -- "$cli" logits -m "$fixture"
expect cli_unknown_flag "not expected: --bogus" -- "$cli" info -m "$fixture" --bogus
expect seed_without_random_weights "--weights-seed draws --random-weights" -- "$cli" logits -m "$fixture" --ids 1 --weights-seed 5
expect cuda_with_threads "--threads sets CPU threads: it is for --device cpu" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --threads 2
expect cuda_with_exec "--exec naive: the CPU's expert execution" -- "$cli" logits -m "$fixture" --ids 1 --device cuda --exec naive
bench=${MOE_BENCH:-$(dirname "$cli")/moe-bench}
expect bench_unknown_flag "not expected: --bogus" -- "$bench" layer --bogus
expect bench_runs_not_a_number "--runs" -- "$bench" layer --runs many
expect bench_unknown_preset "unknown layer preset" -- "$bench" layer --preset gpt5
expect bench_ep_too_large "must be in \\[1, 8\\]" -- "$bench" layer --ep 9
expect bench_bad_device "valid devices are auto, cpu and cuda" -- "$bench" layer --device tpu
expect bench_cuda_needs_bf16 "bf16|no CUDA backend" -- "$bench" layer --device cuda --dtype f32
expect bench_fp8_one_gpu "fp8 \\(E4M3 in 128 x 128 blocks\\) on one GPU|no CUDA backend" -- "$bench" layer --device cuda --dtype fp8 --ep 2
expect bench_fp8_on_cpu "bf16 and fp8 run on --device cuda" -- "$bench" layer --device cpu --dtype fp8
expect bench_cuda_bad_ep "must be in \\[1, 8\\]" -- "$bench" layer --device cuda --ep -1
expect bench_skew_range "--routing-skew must be in \\[0, 10\\], got -1" -- "$bench" layer --device cuda --routing-skew -1
expect bench_skew_on_cpu "--routing-skew is for the single-GPU CUDA layer bench" -- "$bench" layer --device cpu --routing-skew 1.5
expect bench_skew_with_ep "--routing-skew is for the single-GPU CUDA layer bench" -- "$bench" layer --device cuda --ep 2 --routing-skew 1.5
expect bench_cuda_ep_warmup "must be >= 1 here|no CUDA backend" -- "$bench" layer --device cuda --ep 2 --warmup 0
# Options that do nothing on the device chosen are refused, not dropped.
expect bench_cuda_threads "--threads sets CPU threads: it is for --device cpu" -- "$bench" layer --device cuda --preset qwen3-30b-a3b --threads 4
expect bench_cuda_ep_threads "--threads sets CPU threads: it is for --device cpu" -- "$bench" layer --device cuda --ep 2 --threads 4
expect bench_cuda_unknown_path "--modes foo: the paths of one GPU are gemv, gemm and wgmma" -- "$bench" layer --device cuda --preset qwen3-30b-a3b --modes wgmma,foo
expect bench_cuda_cpu_mode "--modes dense: the paths of one GPU are gemv, gemm and wgmma" -- "$bench" layer --device cuda --preset qwen3-30b-a3b --modes dense
expect bench_cuda_runs_zero "--runs must be >= 1, --warmup >= 0" -- "$bench" layer --device cuda --preset qwen3-30b-a3b --runs 0
expect bench_cpu_unknown_mode "--modes ep_packedx: the CPU's modes are dense, ep_padded" -- "$bench" layer --device cpu --modes dense,ep_packedx
expect bench_cpu_ep_mode_one_rank "--modes ep_packed runs over --ep ranks: give --ep 2 or more" -- "$bench" layer --device cpu --ep 1 --modes dense,ep_packed
expect bench_cuda_ep_unknown_mode "--modes nccl: the modes over GPUs are dense|no CUDA backend" -- "$bench" layer --device cuda --ep 2 --modes p2p,nccl
expect bench_cpu_runs_zero "--runs must be >= 1, --warmup >= 0" -- "$bench" layer --device cpu --runs 0
if ! nvidia-smi -L >/dev/null 2>&1; then  # the GPU count is checked where there are too few
  expect bench_cuda_ep_needs_gpus "needs 2 GPUs; this machine has 0|no CUDA backend" -- "$bench" layer --device cuda --ep 2
  expect bench_cuda_needs_a_gpu "needs a CUDA GPU; this machine has none|no CUDA backend" -- "$bench" layer --device cuda --preset qwen3-30b-a3b --tokens 8
fi
expect bench_model_preset_without_weights "add --random-weights" -- "$bench" model --preset qwen3-moe-mid
expect bench_model_too_big "this machine has" -- "$bench" model --preset deepseek-v3 --random-weights
expect bench_model_bad_device "expected cpu or cuda" -- "$bench" model --preset qwen3-moe-mid --random-weights --device tpu
expect bench_model_bad_batches "batch sizes must be >= 1" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --batches 1,0
expect bench_model_tp_on_cpu "runs on GPUs only" -- "$bench" model --preset qwen3-moe-mid --random-weights --tp 2
expect bench_model_cuda_tp_without_ep "runs over the expert-parallel GPUs" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --tp 2
expect bench_model_cuda_ep_backend "--ep-backend deepep: this build has no DeepEP kernels" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --ep 2 --ep-backend deepep
expect bench_model_dp_on_cpu "runs on GPUs only" -- "$bench" model --preset qwen3-moe-mid --random-weights --dp 2 --ep 2
expect bench_model_cuda_dp_through_allreduce "use allgather_reducescatter" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --ep 2 --dp 2
expect bench_model_bad_prefill_len "--prefill-len must be >= 0" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --prefill-len -1
expect bench_model_cuda_threads "--threads sets CPU threads: it is for --device cpu" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --threads 2
expect bench_model_cuda_exec "--exec naive: the CPU's expert execution" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --exec naive
expect bench_model_batch_and_batches "give --batch or --batches, not both" -- "$bench" model --preset qwen3-moe-mid --random-weights --device cuda --batch 2 --batches 1,8
expect bench_model_cpu_batches "--batches is for --device cuda" -- "$bench" model --preset qwen3-moe-mid --random-weights --batches 1,8
expect bench_model_cpu_prefill_len "--prefill-len is for --device cuda" -- "$bench" model --preset qwen3-moe-mid --random-weights --prefill-len 128
expect bench_model_cpu_profile "--profile is for --device cuda" -- "$bench" model --preset qwen3-moe-mid --random-weights --profile
expect bench_model_cpu_no_fuse "--no-fuse is for --device cuda" -- "$bench" model --preset qwen3-moe-mid --random-weights --no-fuse
expect bench_model_batch_zero "--batch and --input-len must be >= 1" -- "$bench" model --preset qwen3-moe-mid --random-weights --batch 0

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
