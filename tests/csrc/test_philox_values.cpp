// csrc/common/philox.h's noise stream, element by element, against values of an
// independent float64 transcription of the documented formula (plain Python, as
// _normal_at in tests/ops/test_compiled_ops.py): counter offset + n / 4, key = seed,
// uniforms ((x >> 9) + 0.5) / 2^23, Box-Muller with the angle 2 pi (u - 0.5) in
// [-pi, pi). test_philox.cpp checks the bijection (Random123 answers) and the moments;
// the moments cannot see a changed angle convention, which the CUDA kernel would then
// not share with the CPU kernel (their noise must agree element for element).
#include <cstdint>

#include "check.h"
#include "common/philox.h"

struct Known {
  uint64_t seed, offset, n;
  double value;
};

int main() {
  const Known known[] = {
      {0x0123456789abcdefull, 40u, 0u, -0.947323262}, {0x0123456789abcdefull, 40u, 1u, -0.005761331},
      {0x0123456789abcdefull, 40u, 2u, 0.331734987},  {0x0123456789abcdefull, 40u, 3u, 0.553634237},
      {0x0123456789abcdefull, 40u, 4u, 0.059847515},  {0x0123456789abcdefull, 40u, 5u, 1.433707621},
      {0x0123456789abcdefull, 40u, 6u, -0.446670244}, {0x0123456789abcdefull, 40u, 7u, -0.528613766},
      {0u, 0u, 0u, -0.991137475},                      {0u, 0u, 1u, 0.924662780},
      {0u, 0u, 2u, 0.617609055},                       {0u, 0u, 3u, 0.482068347},
      // counter offset + n / 4 = 2^32: the 64-bit counter's high word
      {7u, 0xffffffffull, 4u, -1.147888996},           {7u, 0xffffffffull, 5u, -1.443000008},
  };
  for (const Known& k : known) {
    CHECK_NEAR(vqlcmd::normal_at(k.seed, k.offset, k.n), k.value, 1e-5 * (1.0 + std::fabs(k.value)));
  }
  // the angle's interval: [-pi, pi) over the open uniforms
  CHECK(vqlcmd::box_muller_angle(vqlcmd::uniform_open(0u)) < -3.14159f);
  CHECK(vqlcmd::box_muller_angle(vqlcmd::uniform_open(0xffffffffu)) > 3.14159f - 1e-5f);
  CHECK(vqlcmd::box_muller_angle(vqlcmd::uniform_open(0xffffffffu)) < 3.14159266f);
  return g_failures;
}
