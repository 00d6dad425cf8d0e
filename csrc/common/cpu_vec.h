// CPU helpers: rows are converted to float32 once (bf16/fp16) or used in place
// (fp32), then processed with at::vec::Vectorized<float> (AVX2 where built for it).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "philox.h"

namespace vqlcmd::cpu {

using Vec = at::vec::Vectorized<float>;

// Row `src` as float32: the row itself for fp32, else converted into `buf`.
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

// Where a float32 result row should be written: straight into an fp32 output,
// else into `buf`, to be stored with store_row().
template <typename T>
inline float* out_row(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) return dst; else return buf;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) at::vec::convert(src, dst, n);
}

inline float reduce_sum(Vec v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.0f;
  for (int i = 0; i < Vec::size(); ++i) s += lanes[i];
  return s;
}

inline float reduce_max(Vec v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int i = 1; i < Vec::size(); ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

constexpr int kPhiloxBatch = 64;

// philox_block() for blocks b0 .. b0+n-1 (n <= kPhiloxBatch), as uniforms: pair
// 2j of the range is (ua[2j], ub[2j]) = (x0, x1) of block j, pair 2j+1 is (x2, x3).
// The counters live in arrays and each round runs over all of them, so the
// compiler vectorizes the 32x32->64-bit multiplies.
inline void philox_uniform_pairs(uint64_t seed, uint64_t offset, uint64_t b0, int n, float* ua, float* ub) {
  uint32_t c0[kPhiloxBatch], c1[kPhiloxBatch], c2[kPhiloxBatch], c3[kPhiloxBatch];
  for (int j = 0; j < n; ++j) {
    const uint64_t c = offset + b0 + j;
    c0[j] = static_cast<uint32_t>(c);
    c1[j] = static_cast<uint32_t>(c >> 32);
    c2[j] = c3[j] = 0;
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    for (int j = 0; j < n; ++j) philox_round(c0[j], c1[j], c2[j], c3[j], k0, k1);
  }
  for (int j = 0; j < n; ++j) {
    ua[2 * j] = uniform_open(c0[j]);
    ub[2 * j] = uniform_open(c1[j]);
    ua[2 * j + 1] = uniform_open(c2[j]);
    ub[2 * j + 1] = uniform_open(c3[j]);
  }
}

// Noise elements n0 .. n0+count-1 (philox.h's normal_at), with Philox batched
// and Box-Muller in vector instructions: every pair (a, b) of uniforms the range
// touches becomes (r cos, r sin).
inline void philox_normals(uint64_t seed, uint64_t offset, uint64_t n0, int64_t count, float* out,
                           std::vector<float>& scratch) {
  if (count <= 0) return;
  const uint64_t b0 = n0 / 4, b1 = (n0 + count - 1) / 4;
  const int64_t blocks = static_cast<int64_t>(b1 - b0 + 1), pairs = 2 * blocks;
  scratch.resize(2 * pairs);
  float* ua = scratch.data();
  float* ub = ua + pairs;
  for (int64_t j = 0; j < blocks; j += kPhiloxBatch) {
    const int n = static_cast<int>(std::min<int64_t>(kPhiloxBatch, blocks - j));
    philox_uniform_pairs(seed, offset, b0 + j, n, ua + 2 * j, ub + 2 * j);
  }
  const Vec minus_two(-2.0f), two_pi(kTwoPi);
  int64_t j = 0;
  for (; j + Vec::size() <= pairs; j += Vec::size()) {
    const Vec radius = (minus_two * Vec::loadu(ua + j).log()).sqrt();
    const Vec theta = two_pi * Vec::loadu(ub + j);
    (radius * theta.cos()).store(ua + j);
    (radius * theta.sin()).store(ub + j);
  }
  for (; j < pairs; ++j) {
    const float radius = sqrtf(-2.0f * logf(ua[j]));
    const float theta = kTwoPi * ub[j];
    ua[j] = radius * cosf(theta);
    ub[j] = radius * sinf(theta);
  }
  const uint64_t p0 = 2 * b0;
  for (int64_t d = 0; d < count; ++d) {
    const uint64_t n = n0 + d;
    const int64_t pair = static_cast<int64_t>(n / 2 - p0);
    out[d] = (n & 1) ? ub[pair] : ua[pair];
  }
}

}  // namespace vqlcmd::cpu
