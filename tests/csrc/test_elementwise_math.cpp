// The per-element formulas of noise_embeddings and ddim_teacher_step (VQ-LCMD.md
// training steps 2 and 3) on hand-computed values.
#include "check.h"
#include "ddim_teacher_step/ddim_teacher_step.h"
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
  return g_failures;
}
