#include "ops/ops.h"

#include "backend/cpu/kernels.h"
#include "moe/errors.h"

namespace moe::ops {

namespace {
void require_cpu_f32(const Tensor& t, const char* op, const char* what) {
  MOE_CHECK(t.dtype() == DType::kF32, kShape, "{}: {} must be f32, got {}", op, what,
            dtype_name(t.dtype()));
  MOE_CHECK(t.device().type == DeviceType::kCPU, kUnsupported,
            "{}: {} is on {}, and this operator has only a CPU implementation here", op, what,
            t.device().str());
}
}  // namespace

void linear(ThreadPool& pool, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  require_cpu_f32(x, "linear", "x");
  require_cpu_f32(w, "linear", "w");
  require_cpu_f32(y, "linear", "y");
  MOE_CHECK(x.ndim() == 2 && w.ndim() == 2 && y.ndim() == 2 && x.dim(1) == w.dim(1) &&
                y.dim(0) == x.dim(0) && y.dim(1) == w.dim(0),
            kShape, "linear: x {} · w {}^T does not fit y {}", x.shape_str(), w.shape_str(),
            y.shape_str());
  if (bias) {
    require_cpu_f32(*bias, "linear", "bias");
    MOE_CHECK(bias->numel() == w.dim(0), kShape, "linear: bias {} for w {}", bias->shape_str(),
              w.shape_str());
  }
  cpu::linear(pool, x.data<float>(), w.data<float>(), bias ? bias->data<float>() : nullptr,
              y.data<float>(), x.dim(0), x.dim(1), w.dim(0));
}

void rms_norm(ThreadPool& pool, const Tensor& x, const Tensor& weight, float eps, Tensor& out) {
  require_cpu_f32(x, "rms_norm", "x");
  MOE_CHECK(x.ndim() == 2 && weight.numel() == x.dim(1) && out.shape() == x.shape(), kShape,
            "rms_norm: x {} weight {} out {}", x.shape_str(), weight.shape_str(), out.shape_str());
  cpu::rms_norm(pool, x.data<float>(), weight.data<float>(), out.data<float>(), x.dim(0),
                x.dim(1), eps);
}

void rms_norm_groups(ThreadPool& pool, Tensor& x, const Tensor& weight, float eps) {
  require_cpu_f32(x, "rms_norm_groups", "x");
  int64_t width = weight.numel();
  MOE_CHECK(width > 0 && x.numel() % width == 0, kShape, "rms_norm_groups: x {} by groups of {}",
            x.shape_str(), width);
  cpu::rms_norm(pool, x.data<float>(), weight.data<float>(), x.data<float>(), x.numel() / width,
                width, eps);
}

void silu_mul(const Tensor& gate_up, Tensor& out) {
  MOE_CHECK(gate_up.ndim() == 2 && out.ndim() == 2 && gate_up.dim(0) == out.dim(0) &&
                gate_up.dim(1) == 2 * out.dim(1),
            kShape, "silu_mul: gate_up {} out {}", gate_up.shape_str(), out.shape_str());
  cpu::silu_mul(gate_up.data<float>(), out.data<float>(), out.dim(0), out.dim(1));
}

void add_inplace(Tensor& x, const Tensor& y) {
  MOE_CHECK(x.numel() == y.numel(), kShape, "add: {} + {}", x.shape_str(), y.shape_str());
  float* a = x.data<float>();
  const float* b = y.data<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) a[i] += b[i];
}

}  // namespace moe::ops
