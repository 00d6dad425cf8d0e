// csrc/common/philox.h against the Random123 known-answer vectors
// (tests/kat_vectors of github.com/DEShawResearch/random123, "philox4x32 10"
// lines) and the moments of the Gaussian it produces.
#include <cstdint>

#include "check.h"
#include "common/philox.h"

using vqlcmd::Philox4;

static void check_kat(Philox4 ctr, uint32_t k0, uint32_t k1, Philox4 expected) {
  const Philox4 got = vqlcmd::philox4x32_10(ctr, k0, k1);
  for (int i = 0; i < 4; ++i) CHECK(got.x[i] == expected.x[i]);
}

int main() {
  check_kat({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  check_kat({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
            {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  check_kat({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
            {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});

  // uniforms stay inside (0, 1), so Box-Muller's log is finite
  CHECK(vqlcmd::uniform_open(0u) > 0.0f);
  CHECK(vqlcmd::uniform_open(0xffffffffu) < 1.0f);

  // element n of the stream is block offset + n / 4 (the layout the kernels rely on)
  const uint64_t seed = 0x0123456789abcdefull, offset = 40;
  const Philox4 block = vqlcmd::philox_block(seed, offset, 2);
  float z0, z1;
  vqlcmd::box_muller(block.x[2], block.x[3], &z0, &z1);
  CHECK(vqlcmd::normal_at(seed, offset, 10) == z0);
  CHECK(vqlcmd::normal_at(seed, offset, 11) == z1);
  CHECK(vqlcmd::normal_at(seed, offset + 1, 6) == vqlcmd::normal_at(seed, offset, 10));

  // N(0, 1): mean, variance, P(|z| < 1), and no correlation between Box-Muller partners
  const int n = 1 << 20;
  double sum = 0, sq = 0, inside = 0, cross = 0;
  for (int i = 0; i < n; ++i) {
    const double z = vqlcmd::normal_at(seed, 0, i);
    sum += z;
    sq += z * z;
    inside += std::fabs(z) < 1.0;
    if (i % 2 == 1) cross += z * vqlcmd::normal_at(seed, 0, i - 1);
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  CHECK_NEAR(mean, 0.0, 5.0 / std::sqrt(n));
  CHECK_NEAR(var, 1.0, 5.0 * std::sqrt(2.0 / n));
  CHECK_NEAR(inside / n, 0.682689492, 5.0 * std::sqrt(0.2167 / n));
  CHECK_NEAR(cross / (n / 2), 0.0, 5.0 / std::sqrt(n / 2.0));
  return g_failures;
}
