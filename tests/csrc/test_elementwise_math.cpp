// The per-element formulas of noise_embeddings and ddim_teacher_step (docs/method.md
// eq. 6 and eq. 10) on hand-computed values, gelu_tanh's sigmoid form
// against the tanh form it rewrites, and ada_layer_norm's row math against
// hand-computed moments and finite differences.
#include "ada_layer_norm/ada_layer_norm.h"
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

  // ada_layer_norm: x = 1..4 has mean 2.5 and biased variance 1.25
  {
    const float x[4] = {1, 2, 3, 4}, a[4] = {0, 1, -0.5f, 2}, b[4] = {0, 1, 0.25f, -1};
    float y[4];
    const RowMoments m = ada_ln_row_forward(x, a, b, y, 4, 0.0f);
    CHECK_NEAR(m.mean, 2.5, 1e-7);
    CHECK_NEAR(m.rstd, 1.0 / std::sqrt(1.25), 1e-6);
    for (int j = 0; j < 4; ++j) CHECK_NEAR(y[j], (1 + a[j]) * (x[j] - 2.5) / std::sqrt(1.25) + b[j], 1e-6);
    // gradients of L = sum_j c_j y_j against central differences of the double formula
    const double c[4] = {0.3, -1.2, 0.7, 2.0};
    const auto loss = [&](const double* xs, const double* as, const double* bs) {
      double mean = 0, var = 0, l = 0;
      for (int j = 0; j < 4; ++j) mean += xs[j] / 4;
      for (int j = 0; j < 4; ++j) var += (xs[j] - mean) * (xs[j] - mean) / 4;
      for (int j = 0; j < 4; ++j) l += c[j] * ((1 + as[j]) * (xs[j] - mean) / std::sqrt(var + 1e-5) + bs[j]);
      return l;
    };
    const float g[4] = {0.3f, -1.2f, 0.7f, 2.0f};
    float dh[4], da[4] = {0, 0, 0, 0}, db[4] = {0, 0, 0, 0};
    const RowMoments m5 = ada_ln_moments(x, 4, 1e-5f);
    ada_ln_row_backward(g, x, a, m5, dh, da, db, 4);
    for (int j = 0; j < 4; ++j) {
      double xs[4], as[4], bs[4];
      for (int k = 0; k < 4; ++k) xs[k] = x[k], as[k] = a[k], bs[k] = b[k];
      const double eps = 1e-5;
      xs[j] += eps;
      double up = loss(xs, as, bs);
      xs[j] -= 2 * eps;
      CHECK_NEAR(dh[j], (up - loss(xs, as, bs)) / (2 * eps), 1e-4);
      xs[j] += eps;
      as[j] += eps;
      up = loss(xs, as, bs);
      as[j] -= 2 * eps;
      CHECK_NEAR(da[j], (up - loss(xs, as, bs)) / (2 * eps), 1e-4);
      as[j] += eps;
      CHECK_NEAR(db[j], c[j], 1e-6);
    }
    // a constant row normalises to 0 (eps keeps rstd finite): y = b, and no gradient reaches h
    const float flat[4] = {3, 3, 3, 3};
    ada_ln_row_forward(flat, a, b, y, 4, 1e-5f);
    for (int j = 0; j < 4; ++j) CHECK_NEAR(y[j], b[j], 0.0);
  }
  return g_failures;
}
