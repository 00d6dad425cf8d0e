// The per-element formulas of noise_embeddings and ddim_teacher_step (VQ-LCMD.md
// training steps 2 and 3) on hand-computed values, and gelu_tanh's sigmoid form
// against the tanh form it rewrites.
#include "check.h"
#include "ddim_teacher_step/ddim_teacher_step.h"
#include "gelu_tanh/gelu_tanh.h"
#include "noise_embeddings/noise_embeddings.h"

using namespace vqlcmd;

int main() {
  CHECK(noised_row(5, false, 9) == 5);
  CHECK(noised_row(5, true, 9) == 9);
  CHECK(row_in_range(0, 3) && row_in_range(2, 3));
  CHECK(!row_in_range(3, 3) && !row_in_range(-1, 3));

  CHECK_NEAR(noise_embedding(2.0f, -1.0f, 0.6f, 0.8f), 0.6 * 2.0 - 0.8, 1e-6);

  // z_s = a_s e + (s_s / s_t)(z_t - a_t e)
  const float e = 0.5f, z_t = -1.25f, a_t = 0.6f, s_t = 0.8f, a_s = 0.9f, s_s = 0.43588989f;
  CHECK_NEAR(ddim_step(e, z_t, a_t, a_s, s_s / s_t), a_s * e + (s_s / s_t) * (z_t - a_t * e), 1e-6);
  // s = t is the identity, and s = 0 (a_s = 1, s_s = 0) returns the clean embedding
  CHECK_NEAR(ddim_step(e, z_t, a_t, a_t, 1.0f), z_t, 1e-6);
  CHECK_NEAR(ddim_step(e, z_t, a_t, 1.0f, 0.0f), e, 0.0);

  // gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), evaluated in double; the
  // gradient against a central difference of that double formula
  const auto tanh_form = [](double x) {
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
  };
  for (float x = -6.0f; x <= 6.0f; x += 0.25f) {
    CHECK_NEAR(gelu_tanh(x), tanh_form(x), 1e-6 * (1.0 + std::fabs(x)));
    const double h = 1e-5, fd = (tanh_form(x + h) - tanh_form(x - h)) / (2 * h);
    CHECK_NEAR(gelu_tanh_grad(x), fd, 1e-5);
  }
  CHECK(gelu_tanh(0.0f) == 0.0f);
  CHECK_NEAR(gelu_tanh_grad(0.0f), 0.5, 1e-7);
  CHECK(gelu_tanh(-1e4f) == 0.0f && gelu_tanh(1e4f) == 1e4f);  // saturated tails, no NaN
  CHECK(gelu_tanh_grad(-1e4f) == 0.0f && gelu_tanh_grad(1e4f) == 1.0f);
  return g_failures;
}
