// CPU kernels of gelu_tanh: forward y = x sigmoid(v(x)) and backward
// dx = grad * gelu_tanh_grad(x) (gelu_tanh.h), one vectorised pass each.
// No CUDA kernel: on GPUs PyTorch's GELU is one memory-bound pass already; the
// tanh it computes is only expensive on CPUs (see gelu_tanh.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/cpu_vec.h"
#include "../common/dispatch.h"
#include "gelu_tanh.h"

namespace vqlcmd {
namespace {

using cpu::Vec;

constexpr int64_t kGrain = 32768;  // elements per parallel task
constexpr int64_t kBlock = 1024;   // bf16/fp16 elements converted to float32 at a time

inline Vec sigmoid_v(Vec x) { return Vec(1.0f) / (Vec(1.0f) + gelu_tanh_v(x).neg().exp()); }

void forward_floats(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec vx = Vec::loadu(x + i);
    (vx * sigmoid_v(vx)).store(y + i);
  }
  for (; i < n; ++i) y[i] = gelu_tanh(x[i]);
}

void backward_floats(const float* g, const float* x, float* dx, int64_t n) {
  const Vec one(1.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec vx = Vec::loadu(x + i);
    const Vec s = sigmoid_v(vx);
    (Vec::loadu(g + i) * (s + vx * s * (one - s) * gelu_tanh_dv(vx))).store(dx + i);
  }
  for (; i < n; ++i) dx[i] = g[i] * gelu_tanh_grad(x[i]);
}

// Both passes run over [0, n) in parallel; bf16/fp16 operands are converted to
// float32 in blocks and the result converted back.
template <typename T>
void forward(const T* x, T* y, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>) {
      forward_floats(x + lo, y + lo, hi - lo);
    } else {
      float xb[kBlock], yb[kBlock];
      for (int64_t b = lo; b < hi; b += kBlock) {
        const int64_t m = std::min(kBlock, hi - b);
        at::vec::convert(x + b, xb, m);
        forward_floats(xb, yb, m);
        at::vec::convert(yb, y + b, m);
      }
    }
  });
}

template <typename T>
void backward(const T* g, const T* x, T* dx, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>) {
      backward_floats(g + lo, x + lo, dx + lo, hi - lo);
    } else {
      float gb[kBlock], xb[kBlock], db[kBlock];
      for (int64_t b = lo; b < hi; b += kBlock) {
        const int64_t m = std::min(kBlock, hi - b);
        at::vec::convert(g + b, gb, m);
        at::vec::convert(x + b, xb, m);
        backward_floats(gb, xb, db, m);
        at::vec::convert(db, dx + b, m);
      }
    }
  });
}

at::Tensor gelu_tanh_cpu(const at::Tensor& x) {
  check_float_kind(x, "gelu_tanh: x");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc, at::MemoryFormat::Contiguous);
  if (y.numel() == 0) return y;
  VQLCMD_DISPATCH_FLOAT(x.scalar_type(), "gelu_tanh_cpu", [&] {
    forward<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), y.numel());
  });
  return y;
}

at::Tensor gelu_tanh_backward_cpu(const at::Tensor& grad, const at::Tensor& x) {
  check_float_kind(x, "gelu_tanh_backward: x");
  TORCH_CHECK(grad.sizes() == x.sizes(), "gelu_tanh_backward: grad has shape ", grad.sizes(), " but x has ",
              x.sizes());
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = grad.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(xc, at::MemoryFormat::Contiguous);
  if (dx.numel() == 0) return dx;
  VQLCMD_DISPATCH_FLOAT(x.scalar_type(), "gelu_tanh_backward_cpu", [&] {
    backward<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), dx.numel());
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh_cpu);
  m.impl("gelu_tanh_backward", &gelu_tanh_backward_cpu);
}

}  // namespace vqlcmd
