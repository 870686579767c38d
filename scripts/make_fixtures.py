#!/usr/bin/env python3
"""Writes tiny random checkpoints with Hugging Face transformers, plus the logits and greedy
continuations transformers computes for them. moe.cpp's model tests compare against these.

Each fixture is a directory <out>/<name>/ holding what save_pretrained wrote (config.json,
*.safetensors, maybe an index) and reference.json:
  {"inputs": [[ids...], ...], "logits": [[[f32 x V] x T] per input],
   "greedy": [[ids...] per input], "min_top2_margin": float, "dtype": ..., "transformers": ver}

Weights are drawn at random with a fixed seed and rounded to the checkpoint's dtype *before* the
reference runs, and the reference runs transformers in float32 on the CPU. So an engine that
upcasts the stored weights exactly and computes in f32 should match within f32 rounding,
whatever the checkpoint dtype. Greedy continuations are recomputed from scratch at every step
(no cache) so that they do not depend on transformers' cache code.

usage: python3 scripts/make_fixtures.py --out tests/fixtures [--only name,...]
"""
import argparse
import json
import os
import traceback
import zlib

import torch
import transformers

SMALL = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (architecture class, config class, config kwargs, storage dtype, save kwargs)
FIXTURES = {
    "qwen3_dense_f32": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        SMALL, num_hidden_layers=2, head_dim=16, intermediate_size=128, rope_theta=10000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "qwen3_dense_bf16_tied": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=3, head_dim=8, intermediate_size=72,
        rope_theta=1000000.0, tie_word_embeddings=True), torch.bfloat16, {}),
    "qwen3_moe_f32": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        SMALL, num_hidden_layers=3, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], rope_theta=1000000.0, tie_word_embeddings=False),
        torch.float32, {}),
    "qwen3_moe_nonorm_f32": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        SMALL, num_hidden_layers=4, head_dim=16, intermediate_size=80, moe_intermediate_size=24,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
        mlp_only_layers=[], rope_theta=10000.0, tie_word_embeddings=True),
        torch.float32, {}),
    "qwen3_moe_bf16": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        SMALL, num_hidden_layers=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rope_theta=10000.0, tie_word_embeddings=False),
        torch.bfloat16, {}),
    "mixtral_f32": ("MixtralForCausalLM", "MixtralConfig", dict(
        SMALL, num_key_value_heads=1, num_hidden_layers=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "mixtral_f16_sharded": ("MixtralForCausalLM", "MixtralConfig", dict(
        SMALL, num_hidden_layers=2, intermediate_size=40, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=10000.0, tie_word_embeddings=False),
        torch.float16, {"max_shard_size": "300KB"}),
    "mixtral_bf16": ("MixtralForCausalLM", "MixtralConfig", dict(
        SMALL, num_hidden_layers=3, intermediate_size=32, num_local_experts=6,
        num_experts_per_tok=3, rope_theta=10000.0, tie_word_embeddings=True),
        torch.bfloat16, {}),
    # --- the MoE-subsystem architectures ---
    "deepseek_v2_f32": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_theta=10000.0, tie_word_embeddings=False), torch.float32, {}),
    "deepseek_v2_grouped_f32": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
        first_k_dense_replace=0, moe_layer_freq=1, kv_lora_rank=24, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=False, rope_theta=10000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "deepseek_v3_f32": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=10000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "deepseek_v3_g8_f32": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=32, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=8, topk_group=3,
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_theta=10000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "deepseek_v3_bf16": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        SMALL, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=64,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1,
        routed_scaling_factor=2.0, norm_topk_prob=True, rope_theta=10000.0,
        tie_word_embeddings=False), torch.bfloat16, {}),
    "qwen2_moe_f32": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        SMALL, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0,
        tie_word_embeddings=False), torch.float32, {}),
    "olmoe_f32": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        SMALL, num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, rope_theta=10000.0, tie_word_embeddings=False),
        torch.float32, {}),
    # --- scaled rotary embeddings: a short original context (16) so that the long input below
    # reaches well past it; the names say which spelling config.json ends up with ---
    "qwen3_moe_yarn_f32": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        SMALL, max_position_embeddings=64, num_hidden_layers=2, head_dim=32, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16)), torch.float32, {}),
    "deepseek_v2_yarn_legacy_f32": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        SMALL, max_position_embeddings=128, num_key_value_heads=4, num_hidden_layers=2,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                             original_max_position_embeddings=16, beta_fast=4.0, beta_slow=0.5,
                             mscale=0.707, mscale_all_dim=0.707)), torch.float32, {}),
    "deepseek_v3_yarn_mtp_legacy_bf16": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        SMALL, max_position_embeddings=640, num_key_value_heads=4, num_hidden_layers=3,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        num_nextn_predict_layers=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                             mscale=0.9, mscale_all_dim=1.0)), torch.bfloat16, {}),
    "mixtral_llama3_f32": ("MixtralForCausalLM", "MixtralConfig", dict(
        SMALL, max_position_embeddings=128, num_hidden_layers=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16)),
        torch.float32, {}),
    "qwen3_dense_linear_f32": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        SMALL, num_hidden_layers=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)), torch.float32, {}),
}

# FP8 block-scaled checkpoints, laid out as DeepSeek-V3 and Qwen3-*-FP8 publish them: every
# projection weight stored F8_E4M3 with an f32 `<name>_scale_inv` of one value per 128 x 128 block
# (edge blocks partial), the weight being q x scale of its block; embeddings, norms, routers and
# the lm_head stay in the storage dtype. K dimensions are multiples of 128, some N are not.
FP8_BLOCK = 128
FIXTURES.update({
    "qwen3_moe_fp8": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        SMALL, hidden_size=128, num_hidden_layers=2, head_dim=32, intermediate_size=256,
        moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=1000000.0, tie_word_embeddings=False),
        torch.bfloat16, {}),
    "deepseek_v3_fp8": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        SMALL, hidden_size=128, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=256,
        moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_theta=10000.0, tie_word_embeddings=False), torch.bfloat16, {}),
})
# Their quantization_config, as the real checkpoints write it.
FP8_CONFIG = {
    "qwen3_moe_fp8": {"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [128, 128],
                      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]},
    "deepseek_v3_fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "weight_block_size": [128, 128]},
}

# Fixtures whose config.json is rewritten after saving into the spelling of the Hub's
# checkpoints (top-level rope_theta, `rope_scaling` with "type"), and whose references are then
# computed by the model transformers loads back from that directory.
LEGACY_ROPE = {"deepseek_v2_yarn_legacy_f32", "deepseek_v3_yarn_mtp_legacy_bf16"}
# Fixtures that also get DeepSeek's multi-token-prediction layer, stored as the real checkpoints
# store it: model.layers.<num_hidden_layers>.* in a shard of its own, listed by the index.
WITH_MTP = {"deepseek_v3_yarn_mtp_legacy_bf16"}
# Fixtures that also run one long input, to reach positions past the original context.
LONG_INPUT = {"qwen3_moe_yarn_f32", "deepseek_v2_yarn_legacy_f32", "deepseek_v3_yarn_mtp_legacy_bf16",
              "mixtral_llama3_f32", "qwen3_dense_linear_f32"}

# The bundled demo checkpoint: the real Qwen3 vocabulary so that the real tokenizer drives it,
# everything else tiny. Written to models/ by --demo.
DEMO = ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
    vocab_size=151936, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
    head_dim=8, max_position_embeddings=4096, rms_norm_eps=1e-6, num_hidden_layers=2,
    intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645), torch.bfloat16, {})

INPUTS = [[3, 17, 42, 7, 99], [1], [5, 250, 11, 11, 11, 64, 300, 2, 81, 190, 33, 47, 120, 8,
                                    260, 14, 77, 91, 222, 6, 150, 38, 201, 3]]
LONG = [(37 * i * i + 11 * i + 5) % 383 for i in range(48)]
GREEDY_STEPS = 8


def randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "norm" in name.split(".")[-2]:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def compact(values):
    """Seven significant digits: enough for a 1e-4 bound, half the size of full repr."""
    return [float(f"{v:.7g}") for v in values]


def rewrite_rope_legacy(out_dir):
    """config.json as the Hub's DeepSeek checkpoints spell it: rope_theta at the top level and a
    `rope_scaling` object whose type key is "type"."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def add_mtp_layer(model, out_dir):
    """Appends the multi-token-prediction layer's tensors as DeepSeek-V3's checkpoint holds
    them: a whole decoder layer (a copy of the last one's shapes) plus embed_tokens, enorm,
    hnorm, eh_proj and shared_head, under model.layers.<num_hidden_layers>., in a second shard."""
    from safetensors.torch import load_file, save_file
    n = model.config.num_hidden_layers
    single = os.path.join(out_dir, "model.safetensors")
    main = load_file(single)
    os.remove(single)
    gen = torch.Generator().manual_seed(1234)
    last = f"model.layers.{n - 1}."
    mtp = {}
    for name, t in main.items():
        if name.startswith(last):
            mtp[f"model.layers.{n}." + name[len(last):]] = (0.08 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    h, v = model.config.hidden_size, model.config.vocab_size
    dtype = next(iter(main.values())).dtype
    extra = {"embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,),
             "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h)}
    for name, shape in extra.items():
        mtp[f"model.layers.{n}.{name}"] = (0.08 * torch.randn(shape, generator=gen)).to(dtype)
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    weight_map, total = {}, 0
    for file, tensors in shards.items():
        save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(out_dir, file),
                  metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=2)
    print(f"  mtp layer: {len(mtp)} tensors under model.layers.{n}.")


def fp8_weight(name, t):
    """Whether the real checkpoints store this tensor in FP8: the projections' 2-D weights."""
    return t.dim() == 2 and (name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"))


def quantize_fp8(arch, out_dir, name):
    """Rewrites the saved checkpoint in FP8 blocks and returns the model transformers loads from
    exactly what the checkpoint now holds (each weight q x scale in f32, written to a scratch
    directory in the same layout), so that the reference sees the stored values."""
    import shutil
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out, exact, quantized = {}, {}, 0
    for key, t in tensors.items():
        if not fp8_weight(key, t):
            out[key] = t
            exact[key] = t.float()
            continue
        w = t.float()
        n, k = w.shape
        rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        scale = torch.empty(rows, cols, dtype=torch.float32)
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
                s = max(blk.abs().max().item(), 1e-12) / 448.0
                scale[i, j] = s
                q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (blk / s).to(torch.float8_e4m3fn)
        # The exact value of each stored weight: its code times its block's scale, in f32.
        exact[key] = q.float() * scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        out[key] = q
        out[key[:-len("weight")] + "weight_scale_inv"] = scale
        quantized += 1
    os.remove(path)
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})
    scratch = out_dir + ".exact"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    shutil.copy(os.path.join(out_dir, "config.json"), scratch)
    save_file({k: v.contiguous() for k, v in exact.items()}, os.path.join(scratch, "model.safetensors"),
              metadata={"format": "pt"})
    model = getattr(transformers, arch).from_pretrained(scratch, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    shutil.rmtree(scratch)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = FP8_CONFIG[name]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    print(f"  fp8: {quantized} weights in {FP8_BLOCK} x {FP8_BLOCK} blocks")
    return model


def build(spec, seed, out_dir, full_logits=True, name=""):
    arch, config_cls, kwargs, dtype, save_kwargs = spec
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).eval()
    randomize(model, seed)
    # Round to the storage dtype first, so the f32 reference sees exactly the stored weights.
    # Only what is stored: rotary inv_freq buffers are recomputed in f32 at load, never rounded.
    stored = list(model.parameters()) + [b for n, b in model.named_buffers()
                                         if "e_score_correction_bias" in n]
    with torch.no_grad():
        for t in stored:
            t.copy_(t.to(dtype).to(torch.float32))
    model = model.float()
    os.makedirs(out_dir, exist_ok=True)
    if name in FP8_CONFIG:
        model.to(dtype).save_pretrained(out_dir, **save_kwargs)
        model = quantize_fp8(arch, out_dir, name)
        saved = True
    elif name in LEGACY_ROPE or name in WITH_MTP:
        # Save first, rewrite as the Hub's checkpoints look, and take the references from what
        # transformers loads back: that is what a user of the real checkpoint gets.
        model.to(dtype).save_pretrained(out_dir, **save_kwargs)
        if name in LEGACY_ROPE:
            rewrite_rope_legacy(out_dir)
        if name in WITH_MTP:
            add_mtp_layer(model, out_dir)
        reloaded = getattr(transformers, arch).from_pretrained(
            out_dir, dtype=torch.float32, attn_implementation="eager").eval()
        probe = torch.tensor([LONG])
        with torch.no_grad():
            diff = (reloaded(probe).logits - model.float()(probe).logits).abs().max().item()
        print(f"  reloaded from the rewritten directory: max |logit diff| vs the written model {diff:.3g}")
        model = reloaded
        saved = True
    else:
        saved = False
    refs = {"inputs": [], "logits": [], "greedy": [], "dtype": str(dtype).split(".")[-1],
            "transformers": transformers.__version__, "torch": torch.__version__,
            "architecture": arch}
    margins = []
    inputs = INPUTS + ([LONG] if name in LONG_INPUT else [])
    with torch.no_grad():
        for ids in inputs:
            ids = [i % config.vocab_size for i in ids]
            logits = model(torch.tensor([ids])).logits[0].float()
            refs["inputs"].append(ids)
            rows = logits if full_logits else logits[-1:]
            refs["logits"].append([compact(r.tolist()) for r in rows])
            seq = list(ids)
            for _ in range(GREEDY_STEPS):
                last = model(torch.tensor([seq])).logits[0, -1].float()
                top2 = torch.topk(last, 2).values
                margins.append(float(top2[0] - top2[1]))
                seq.append(int(torch.argmax(last)))
            refs["greedy"].append(seq[len(ids):])
    refs["min_top2_margin"] = min(margins)
    refs["logits_rows"] = "all" if full_logits else "last"
    if not saved:
        model.to(dtype).save_pretrained(out_dir, **save_kwargs)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(refs, f)
    from safetensors import safe_open
    keys = sorted(k for f in os.listdir(out_dir) if f.endswith(".safetensors")
                  for k in safe_open(os.path.join(out_dir, f), "pt").keys())
    print(f"{out_dir}: {arch} {refs['dtype']} margin={refs['min_top2_margin']:.4f} "
          f"files={sorted(os.listdir(out_dir))}")
    print("  keys:", [k for k in keys if ".layers.0." in k or ".layers." not in k])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--demo", default=None, help="also write the demo checkpoint here")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(8)
    names = [n for n in FIXTURES if not args.only or n in args.only.split(",")]
    failed = []
    for name in names:
        try:
            # The seed depends on the name only, so --only regenerates a fixture identically.
            build(FIXTURES[name], zlib.crc32(name.encode()), os.path.join(args.out, name), name=name)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if args.demo:
        build(DEMO, 7, args.demo, full_logits=False)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    if failed:
        print("FAILED:", failed)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
