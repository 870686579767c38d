#!/usr/bin/env python3
"""Records transformers' own FP8 forward on the FP8 fixtures: the W8A8 numerics that FP8
deployments run (activations quantised to E4M3 per token and 128 channels on the fly, the
products with the weights' 128 x 128 block scales accumulated in f32), beside the exact
reference of scripts/make_fixtures.py (weights dequantised exactly, activations never rounded).
moe.cpp's GPU tests hold their W8A8 paths to the distance measured here.

transformers (5.x) loads an FP8 checkpoint into its own FP8Linear and FP8Experts modules, which
keep the E4M3 codes and scales and hand every product to three entry points of the
`kernels-community/finegrained-fp8` Triton kernel, fetched from the Hugging Face Hub at first use
(`matmul_2d`, `matmul_batched`, `matmul_grouped`; DeepGEMM where it is installed). Machines
without Hub access cannot fetch it, so this script supplies the three entry points itself, in
plain PyTorch, with the kernel's contract and numerics:
  - each row of the input is quantised per block_size[1] channels: scale = max(|x|, 1e-10) / 448
    over the block, codes = E4M3(x / scale) (round to nearest, saturating at 448);
  - each output is the sum over K of (code_x * scale_x) * (code_w * scale_w), in f32 (TF32 off);
  - the result is cast to the caller's dtype.
Everything else (the model, its attention, routing, norms and the experts' dispatch) is
transformers' own code, run in float32 so that W8A8 is the only difference from reference.json.
The accumulation order differs from the Triton kernel's, a few f32 ulps.

Each fixture gets reference_w8a8.json:
  {"inputs": as reference.json, "logits": [[[f32 x V] x T] per input], "greedy": [[ids] per
   input], "vs_exact": {"max_abs_diff_over_scale": [per input], "greedy_equal": [per input]},
   "calls": {entry point: count}, "transformers", "torch", "device", "numerics"}

usage (a machine with a CUDA GPU of compute capability >= 8.9 and transformers >= 5):
  python3 scripts/make_w8a8_references.py [--fixtures tests/fixtures] [--only name,...]
"""
import argparse
import json
import os

os.environ.setdefault("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.integrations import finegrained_fp8 as fg  # noqa: E402

FIXTURES = ["qwen3_moe_fp8", "deepseek_v3_fp8"]
GREEDY_STEPS = 8  # as scripts/make_fixtures.py
E4M3_MAX = 448.0
CALLS = {"matmul": 0, "batched_matmul": 0, "grouped_matmul": 0}


def quantize_rows(x, block):
    """x [M, K] -> its values after per-row, per-`block`-channel E4M3 quantisation, in f32."""
    m, k = x.shape
    pad = (-k) % block
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, block)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
    codes = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).view(m, -1)[:, :k]


def weight_values(w, scale_inv, block_size):
    """The exact f32 value of each stored weight: its code times its block's scale."""
    n, k = w.shape
    s = scale_inv.float()
    if block_size is None or s.dim() == 0:
        return w.float() * s
    bn, bk = block_size
    return w.float() * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def product(x, w, scale_inv, block_size, activation_scale=None):
    if activation_scale is not None:  # static per-tensor activation scale
        s = activation_scale.float()
        xq = (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    else:
        xq = quantize_rows(x.reshape(-1, x.shape[-1]), block_size[1] if block_size else x.shape[-1])
    return xq @ weight_values(w, scale_inv, block_size).t()


def matmul(input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None):
    CALLS["matmul"] += 1
    y = product(input, weight, weight_scale_inv, block_size, activation_scale)
    return y.view(*input.shape[:-1], weight.shape[0]).to(output_dtype or input.dtype)


def batched_matmul(x, w, scale_inv, block_size=None, expert_ids=None, **_):
    """Row s of x through expert expert_ids[s]; ids past the experts leave their row at 0."""
    CALLS["batched_matmul"] += 1
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if e < 0 or e >= w.shape[0]:
            continue
        rows = (expert_ids == e).nonzero(as_tuple=True)[0]
        out[rows] = product(x[rows], w[e], scale_inv[e], block_size)
    return out.to(x.dtype)


def grouped_matmul(x, w, scale_inv, offsets=None, tokens_per_expert=None, block_size=None, **_):
    """Rows grouped by expert: expert e takes rows [offsets[e] - tokens_per_expert[e], offsets[e])."""
    CALLS["grouped_matmul"] += 1
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    ends, counts = offsets.tolist(), tokens_per_expert.tolist()
    for e, (end, count) in enumerate(zip(ends, counts)):
        count = int(count)
        if count > 0:
            out[end - count:end] = product(x[end - count:end], w[e], scale_inv[e], block_size)
    return out.to(x.dtype)


def compact(values):
    return [float(f"{v:.7g}") for v in values]


def run(fixture_dir):
    with open(os.path.join(fixture_dir, "reference.json")) as f:
        exact = json.load(f)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        fixture_dir, dtype=torch.float32, device_map="cuda", attn_implementation="eager").eval()
    fp8_params = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    if not fp8_params:
        raise SystemExit(f"{fixture_dir}: transformers kept no FP8 weights (dequantised at load?)")
    for k in CALLS:
        CALLS[k] = 0
    refs = {"inputs": exact["inputs"], "logits": [], "greedy": [],
            "vs_exact": {"max_abs_diff_over_scale": [], "greedy_equal": []},
            "transformers": transformers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "fp8_weights": len(fp8_params),
            "numerics": "W8A8: activations E4M3 per token and 128 channels, scale max|x|/448 "
                        "(floor 1e-10); f32 products and sums; model in float32",
            "logits_rows": exact.get("logits_rows", "all")}
    with torch.no_grad():
        for i, ids in enumerate(exact["inputs"]):
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
            rows = logits if refs["logits_rows"] == "all" else logits[-1:]
            refs["logits"].append([compact(r.tolist()) for r in rows])
            want = torch.tensor(exact["logits"][i])
            scale = want.abs().max().item()
            refs["vs_exact"]["max_abs_diff_over_scale"].append((rows - want).abs().max().item() / scale)
            seq = list(ids)
            for _ in range(GREEDY_STEPS):
                last = model(torch.tensor([seq], device="cuda")).logits[0, -1].float()
                seq.append(int(torch.argmax(last)))
            refs["greedy"].append(seq[len(ids):])
            refs["vs_exact"]["greedy_equal"].append(refs["greedy"][-1] == exact["greedy"][i])
    refs["calls"] = dict(CALLS)
    if sum(CALLS.values()) == 0:
        raise SystemExit(f"{fixture_dir}: no FP8 product went through the W8A8 entry points")
    with open(os.path.join(fixture_dir, "reference_w8a8.json"), "w") as f:
        json.dump(refs, f)
    print(f"{fixture_dir}: {len(fp8_params)} FP8 weights, calls {CALLS}, "
          f"max |W8A8 - exact| / max |exact| per input {refs['vs_exact']['max_abs_diff_over_scale']}, "
          f"greedy equal {refs['vs_exact']['greedy_equal']}")
    print("  modules:", sorted({type(m).__name__ for m in model.modules() if "FP8" in type(m).__name__}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed: transformers keeps FP8 weights only on one")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fg._FINEGRAINED_FP8 = fg.FineGrainedFP8(matmul=matmul, batched_matmul=batched_matmul,
                                           grouped_matmul=grouped_matmul)
    names = [n for n in FIXTURES if not a.only or n in a.only.split(",")]
    for name in names:
        run(os.path.join(a.fixtures, name))


if __name__ == "__main__":
    main()
