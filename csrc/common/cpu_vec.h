// CPU helpers: rows are converted to float32 once (bf16/fp16) or used in place
// (fp32), then processed with at::vec::Vectorized<float> (AVX2 where built for it).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

// Noise elements n0 .. n0+count-1 (philox.h's normal_at), with Box-Muller in
// vector instructions: Philox fills the uniforms of every pair the range
// touches, then one vector pass turns pairs (a, b) into (r cos, r sin).
inline void philox_normals(uint64_t seed, uint64_t offset, uint64_t n0, int64_t count, float* out,
                           std::vector<float>& scratch) {
  if (count <= 0) return;
  const uint64_t p0 = n0 / 2, p1 = (n0 + count - 1) / 2;
  const int64_t pairs = static_cast<int64_t>(p1 - p0 + 1);
  scratch.resize(2 * pairs);
  float* ua = scratch.data();
  float* ub = ua + pairs;
  Philox4 block{};
  uint64_t cached = ~uint64_t{0};
  for (int64_t j = 0; j < pairs; ++j) {
    const uint64_t p = p0 + j;
    if (p / 2 != cached) {
      cached = p / 2;
      block = philox_block(seed, offset, cached);
    }
    const int half = static_cast<int>(p % 2) * 2;
    ua[j] = uniform_open(block.x[half]);
    ub[j] = uniform_open(block.x[half + 1]);
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
  for (int64_t d = 0; d < count; ++d) {
    const uint64_t n = n0 + d;
    const int64_t pair = static_cast<int64_t>(n / 2 - p0);
    out[d] = (n & 1) ? ub[pair] : ua[pair];
  }
}

}  // namespace vqlcmd::cpu
