// CPU helpers: rows are converted to float32 once (bf16/fp16) or used in place
// (fp32), then processed with at::vec::Vectorized<float> (AVX2 where built for it).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
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

// n values from src to dst, converting where the types differ (float32 <-> bf16/fp16).
template <typename S, typename D>
inline void convert_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
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

#if defined(CPU_CAPABILITY_AVX2)
// Philox4x32-10 (philox.h) on eight consecutive blocks at once: word i of block first_block + j in lane j of
// x[i]. Eight counters per register; mul_epu32 multiplies the even lanes, so the odd lanes are shifted down
// for a second multiply and the halves blended back.
inline void philox_group_avx2(uint64_t seed, uint64_t offset, uint64_t first_block, __m256i x[4]) {
  const auto mulhilo = [](__m256i a, __m256i m, __m256i* lo, __m256i* hi) {
    const __m256i even = _mm256_mul_epu32(a, m);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  };
  const uint64_t c = offset + first_block;
  const __m256i base = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(c)));
  __m256i c0 = _mm256_add_epi32(base, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  // the 64-bit counter carries into the high word where the low word wrapped (unsigned c0 < base)
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(base, sign), _mm256_xor_si256(c0, sign));
  __m256i c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(c >> 32))), carry);
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0)), m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {  // philox_round() on eight counters
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    __m256i lo0, hi0, lo1, hi1;
    mulhilo(c0, m0, &lo0, &hi0);
    mulhilo(c2, m1, &lo1, &hi1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
  }
  x[0] = c0;
  x[1] = c1;
  x[2] = c2;
  x[3] = c3;
}
#endif

// Uniforms of eight consecutive blocks (first_block ..), in the layout philox_normals() reads: for block j
// of the group
//   ua[j], ub[j]         = U(x0), U(x1)  (Box-Muller pair of elements 4b, 4b+1)
//   ua[8 + j], ub[8 + j] = U(x2), U(x3)  (elements 4b+2, 4b+3)
inline void philox_uniform_group(uint64_t seed, uint64_t offset, uint64_t first_block, float* ua, float* ub) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256i x[4];
  philox_group_avx2(seed, offset, first_block, x);
  const auto uniform = [](__m256i w) {  // uniform_open() on eight words
    const __m256 top = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 9));
    return _mm256_mul_ps(_mm256_add_ps(top, _mm256_set1_ps(0.5f)), _mm256_set1_ps(1.0f / 8388608.0f));
  };
  _mm256_storeu_ps(ua, uniform(x[0]));
  _mm256_storeu_ps(ub, uniform(x[1]));
  _mm256_storeu_ps(ua + 8, uniform(x[2]));
  _mm256_storeu_ps(ub + 8, uniform(x[3]));
#else
  for (int j = 0; j < 8; ++j) {
    const Philox4 r = philox_block(seed, offset, first_block + j);
    ua[j] = uniform_open(r.x[0]);
    ub[j] = uniform_open(r.x[1]);
    ua[8 + j] = uniform_open(r.x[2]);
    ub[8 + j] = uniform_open(r.x[3]);
  }
#endif
}

// The words of eight consecutive blocks in stream order: words[4 j + i] = word i of block first_block + j,
// so element n of the stream (philox.h: word n % 4 of block n / 4) is words[n - 4 first_block].
inline void philox_word_group(uint64_t seed, uint64_t offset, uint64_t first_block, uint32_t* words) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256i x[4];
  philox_group_avx2(seed, offset, first_block, x);
  // (x0 x1 x2 x3) lanes 0..7 -> block-major: interleave pairs, then quads
  const __m256i a = _mm256_unpacklo_epi32(x[0], x[1]), b = _mm256_unpackhi_epi32(x[0], x[1]);
  const __m256i c = _mm256_unpacklo_epi32(x[2], x[3]), d = _mm256_unpackhi_epi32(x[2], x[3]);
  const __m256i r0 = _mm256_unpacklo_epi64(a, c), r1 = _mm256_unpackhi_epi64(a, c);  // blocks 0,1 | 4,5
  const __m256i r2 = _mm256_unpacklo_epi64(b, d), r3 = _mm256_unpackhi_epi64(b, d);  // blocks 2,3 | 6,7
  auto* out = reinterpret_cast<__m256i*>(words);
  _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(r0, r1, 0x20));  // blocks 0, 1
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(r2, r3, 0x20));  // blocks 2, 3
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(r0, r1, 0x31));  // blocks 4, 5
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(r2, r3, 0x31));  // blocks 6, 7
#else
  for (int j = 0; j < 8; ++j) {
    const Philox4 r = philox_block(seed, offset, first_block + j);
    for (int i = 0; i < 4; ++i) words[4 * j + i] = r.x[i];
  }
#endif
}

// Dropout's keep-and-rescale factors of stream elements n0 .. n0+count-1: `scale` where the element's word
// (top 24 bits) is at least `threshold` (philox.h's dropout_threshold), else 0.
inline void philox_dropout_scales(uint64_t seed, uint64_t offset, uint64_t n0, int64_t count, uint32_t threshold,
                                  float scale, float* out) {
  uint32_t words[32];
  int64_t d = 0;
  while (d < count) {
    const uint64_t n = n0 + d, block = n / 4;
    philox_word_group(seed, offset, block, words);
    const int64_t first = static_cast<int64_t>(n - 4 * block);
    const int64_t take = std::min<int64_t>(32 - first, count - d);
    for (int64_t e = 0; e < take; ++e) out[d + e] = (words[first + e] >> 8) >= threshold ? scale : 0.0f;
    d += take;
  }
}

// Noise elements n0 .. n0+count-1 (philox.h's normal_at): Philox in groups of
// eight blocks, then Box-Muller in vector instructions turns every pair (a, b)
// of uniforms into (r cos, r sin).
inline void philox_normals(uint64_t seed, uint64_t offset, uint64_t n0, int64_t count, float* out,
                           std::vector<float>& scratch) {
  if (count <= 0) return;
  const uint64_t b0 = n0 / 4, b1 = (n0 + count - 1) / 4;
  const int64_t groups = static_cast<int64_t>((b1 - b0) / 8 + 1), pairs = 16 * groups;
  scratch.resize(2 * pairs);
  float* ua = scratch.data();
  float* ub = ua + pairs;
  for (int64_t g = 0; g < groups; ++g) philox_uniform_group(seed, offset, b0 + 8 * g, ua + 16 * g, ub + 16 * g);
  const Vec minus_two(-2.0f), two_pi(kTwoPi), half(0.5f);
  int64_t j = 0;
  for (; j + Vec::size() <= pairs; j += Vec::size()) {
    const Vec radius = (minus_two * Vec::loadu(ua + j).log()).sqrt();
    const Vec theta = two_pi * (Vec::loadu(ub + j) - half);  // box_muller_angle()
    (radius * theta.cos()).store(ua + j);
    (radius * theta.sin()).store(ub + j);
  }
  for (; j < pairs; ++j) {
    const float radius = sqrtf(-2.0f * logf(ua[j]));
    const float theta = box_muller_angle(ub[j]);
    ua[j] = radius * cosf(theta);
    ub[j] = radius * sinf(theta);
  }
  for (int64_t d = 0; d < count; ++d) {
    const uint64_t n = n0 + d, rb = n / 4 - b0;
    const int64_t idx = static_cast<int64_t>(16 * (rb / 8) + 8 * ((n % 4) / 2) + rb % 8);
    out[d] = (n & 1) ? ub[idx] : ua[idx];
  }
}

}  // namespace vqlcmd::cpu
