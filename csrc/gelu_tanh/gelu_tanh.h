// Per-element math of gelu_tanh (torch-free): DiT's MLP nonlinearity, the tanh
// approximation of GELU, written through the identity 0.5 (1 + tanh(u)) =
// sigmoid(2u) so that it costs one exp instead of a tanh. On AVX2 CPUs the
// vectorised tanh PyTorch uses (Sleef, 1-ulp) is ~4x slower than exp, which made
// its GELU 14% of a CPU training step of the digits model.
#pragma once

#include <cmath>

#include "../common/host_device.h"

namespace vqlcmd {

constexpr float kGeluTwoK = 1.5957691216057308f;   // 2 sqrt(2/pi)
constexpr float kGeluTwoKC = 0.0713548162726009f;  // 2 sqrt(2/pi) * 0.044715

// v = 2u = 2 sqrt(2/pi) (x + 0.044715 x^3) and dv/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2); templates
// so that the CPU kernel's vector loop (T = at::vec::Vectorized<float>) uses the same expressions
template <typename T>
VQLCMD_HD T gelu_tanh_v(T x) { return x * (T(kGeluTwoK) + T(kGeluTwoKC) * x * x); }

template <typename T>
VQLCMD_HD T gelu_tanh_dv(T x) { return T(kGeluTwoK) + T(3.0f * kGeluTwoKC) * x * x; }

// 0.5 x (1 + tanh(u)) = x sigmoid(v): x / (1 + e^-v). For x -> -inf, e^-v
// overflows to inf and the quotient is -0, as the tanh form gives.
VQLCMD_HD float gelu_tanh(float x) { return x / (1.0f + expf(-gelu_tanh_v(x))); }

// d/dx [x sigmoid(v)] = s + x s (1 - s) dv/dx, s = sigmoid(v)
VQLCMD_HD float gelu_tanh_grad(float x) {
  const float s = 1.0f / (1.0f + expf(-gelu_tanh_v(x)));
  return s + x * s * (1.0f - s) * gelu_tanh_dv(x);
}

}  // namespace vqlcmd
