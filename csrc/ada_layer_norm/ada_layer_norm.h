// Per-row math of ada_layer_norm (torch-free): the denoiser's AdaLN,
//   y = (1 + a) * LayerNorm(h) + b,   LayerNorm without affine parameters,
// with (a, b) one pair of vectors per image. PyTorch's CPU LayerNorm costs about
// twelve element-wise passes at width 128 (per-row Welford moments), and the
// modulation adds three more passes forward and five backward; one fused pass
// each way is what the CPU kernel saves (csrc/ada_layer_norm/).
//
// Backward, with n = (h - mean) * rstd and dn = dy * (1 + a):
//   dh = rstd * (dn - mean(dn) - n * mean(dn * n))
//   da = sum over the image's rows of dy * n,   db = sum of dy.
// The templates take T = float (scalar tail, ctest) or at::vec::Vectorized<float>.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/host_device.h"

namespace vqlcmd {

template <typename T>
VQLCMD_HD T ada_ln_normalized(T x, T mean, T rstd) { return (x - mean) * rstd; }

template <typename T>
VQLCMD_HD T ada_ln_out(T n, T a, T b) { return (T(1.0f) + a) * n + b; }

// dh of one element given the row's two means c1 = mean(dn), c2 = mean(dn * n)
template <typename T>
VQLCMD_HD T ada_ln_dh(T dn, T n, T rstd, T c1, T c2) { return rstd * (dn - c1 - n * c2); }

// Two passes (mean, then the centred sum of squares): exact for rows far from zero,
// where E[x^2] - E[x]^2 would cancel.
struct RowMoments {
  float mean;
  float rstd;
};

inline RowMoments ada_ln_moments(const float* x, int64_t w, float eps) {
  float s = 0.0f;
  for (int64_t j = 0; j < w; ++j) s += x[j];
  const float mean = s / static_cast<float>(w);
  float q = 0.0f;
  for (int64_t j = 0; j < w; ++j) q += (x[j] - mean) * (x[j] - mean);
  return {mean, 1.0f / std::sqrt(q / static_cast<float>(w) + eps)};
}

// Scalar reference of one row, forward: y = (1 + a) n + b
inline RowMoments ada_ln_row_forward(const float* x, const float* a, const float* b, float* y, int64_t w, float eps) {
  const RowMoments m = ada_ln_moments(x, w, eps);
  for (int64_t j = 0; j < w; ++j) y[j] = ada_ln_out(ada_ln_normalized(x[j], m.mean, m.rstd), a[j], b[j]);
  return m;
}

// Scalar reference of one row, backward: writes dh, adds the row's share of da and db
inline void ada_ln_row_backward(const float* g, const float* x, const float* a, RowMoments m, float* dh, float* da,
                                float* db, int64_t w) {
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t j = 0; j < w; ++j) {
    const float n = ada_ln_normalized(x[j], m.mean, m.rstd), dn = g[j] * (1.0f + a[j]);
    s1 += dn;
    s2 += dn * n;
  }
  const float c1 = s1 / static_cast<float>(w), c2 = s2 / static_cast<float>(w);
  for (int64_t j = 0; j < w; ++j) {
    const float n = ada_ln_normalized(x[j], m.mean, m.rstd);
    dh[j] = ada_ln_dh(g[j] * (1.0f + a[j]), n, m.rstd, c1, c2);
    da[j] += g[j] * n;
    db[j] += g[j];
  }
}

}  // namespace vqlcmd
