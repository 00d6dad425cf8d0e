// Counter-based Gaussian noise shared by the CPU and CUDA kernels (torch-free).
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a keyed bijection of a 128-bit counter, so element n of the noise is a
// pure function of (seed, offset, n). Any thread, on any device, in any order,
// draws the same number for the same element: this is what lets the CPU and CUDA
// kernels agree and lets the backward pass regenerate the noise instead of
// storing it. Gaussians come from Box-Muller on pairs of uniforms.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace vqlcmd {

struct Philox4 {
  uint32_t x[4];
};

VQLCMD_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// Round constants of the Random123 reference implementation (philox.h there).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

// One round on a counter held in four words (the CPU kernel runs it over arrays
// of counters, which compilers turn into vector code).
VQLCMD_HD void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  uint32_t hi0, hi1;
  const uint32_t lo0 = mulhilo32(kPhiloxM0, c0, &hi0);
  const uint32_t lo1 = mulhilo32(kPhiloxM1, c2, &hi1);
  c0 = hi1 ^ c1 ^ k0;
  c1 = lo1;
  c2 = hi0 ^ c3 ^ k1;
  c3 = lo0;
}

VQLCMD_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key is bumped between rounds, not before the first
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    philox_round(ctr.x[0], ctr.x[1], ctr.x[2], ctr.x[3], k0, k1);
  }
  return ctr;
}

// The block of four outputs that holds noise element n: counter = offset + n / 4
// (64 bits), key = seed (64 bits). Each call of the op advances `offset` past the
// blocks it used, so successive calls draw fresh numbers.
VQLCMD_HD Philox4 philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  const uint64_t c = offset + block;
  const Philox4 ctr{{static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), 0u, 0u}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in the open interval (0, 1): the top 23 bits plus half a step, so
// log(u) in Box-Muller is always finite. (24 bits plus half a step would round
// the largest value up to exactly 1.0f.)
VQLCMD_HD float uniform_open(uint32_t x) {
  return (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

constexpr float kTwoPi = 6.283185307179586f;

// The Box-Muller angle of uniform u, in [-pi, pi) rather than [0, 2 pi): any
// full turn gives the same distribution, and on this interval CUDA's hardware
// __sincosf is accurate to 2^-21 absolute (2.4e-6 on a value, times a radius
// below 5.8). The IEEE sinf/cosf it replaces took 40% of the drawn-noise
// kernel's instructions and a local-memory frame for huge arguments that never
// occur (H100: 18.2 -> 15.1 us for 4.2M normals; cuRAND's own Box-Muller uses
// __sincosf too). u - 0.5f is exact, so CPU and CUDA start from the same float angle.
VQLCMD_HD float box_muller_angle(float u) { return kTwoPi * (u - 0.5f); }

// Box-Muller: two independent N(0, 1) from two independent U(0, 1). The radius
// keeps IEEE logf: near u = 1 the log is tiny and an absolute error of the fast
// __logf would become a large relative error of the radius.
VQLCMD_HD void box_muller(uint32_t a, uint32_t b, float* z0, float* z1) {
  const float radius = sqrtf(-2.0f * logf(uniform_open(a)));
  const float theta = box_muller_angle(uniform_open(b));
  float s, c;
#if defined(__CUDA_ARCH__)
  __sincosf(theta, &s, &c);
#else
  s = sinf(theta);
  c = cosf(theta);
#endif
  *z0 = radius * c;
  *z1 = radius * s;
}

// Noise element n: pair (x0, x1) of its block gives elements 4b, 4b+1 and pair
// (x2, x3) gives 4b+2, 4b+3. The CPU kernel evaluates the same formula with
// vector instructions, pair by pair.
VQLCMD_HD float normal_at(uint64_t seed, uint64_t offset, uint64_t n) {
  const Philox4 r = philox_block(seed, offset, n / 4);
  const int lane = static_cast<int>(n % 4);
  float z0, z1;
  box_muller(r.x[lane & 2], r.x[(lane & 2) + 1], &z0, &z1);
  return (lane & 1) ? z1 : z0;
}

// Dropout with probability p keeps a stream element whose word's top 24 bits are at least this: a uniform
// u = (word >> 8) / 2^24 >= p, compared in integers so that every backend (the reference's int64 Philox
// too) draws the same mask, with p rounded up to a multiple of 2^-24.
inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(std::ceil(p * 16777216.0)); }

// Counter blocks one call uses for `numel` elements; the caller advances the
// generator's offset by this much.
VQLCMD_HD uint64_t philox_blocks(uint64_t numel) { return (numel + 3) / 4; }

}  // namespace vqlcmd
