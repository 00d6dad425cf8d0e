// The per-row math of csrc/categorical_kl/categorical_kl.h against float64
// two-pass formulas: online log-sum-exp, its merge, the KL terms and gradient,
// and the one-read form's sums.
#include <cstdint>
#include <vector>

#include "categorical_kl/categorical_kl.h"
#include "check.h"

using namespace vqlcmd;

// Deterministic pseudo-random logits in [-scale, scale] (a 64-bit LCG).
static std::vector<float> logits(int K, float scale, uint64_t state) {
  std::vector<float> x(K);
  for (float& v : x) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = scale * (2.0f * static_cast<float>(state >> 40) / 16777216.0f - 1.0f);
  }
  return x;
}

static double lse64(const std::vector<float>& x) {
  double m = x[0], s = 0;
  for (float v : x) m = v > m ? v : m;
  for (float v : x) s += std::exp(v - m);
  return m + std::log(s);
}

static OnlineLSE stream(const std::vector<float>& x, size_t lo, size_t hi) {
  OnlineLSE s = lse_empty();
  for (size_t k = lo; k < hi; ++k) s = lse_push(s, x[k]);
  return s;
}

int main() {
  for (int K : {1, 7, 1000, 1024}) {
    for (float scale : {1.0f, 30.0f, 1e4f}) {
      const std::vector<float> t = logits(K, scale, 17 * K + 1), s = logits(K, scale, 31 * K + 5);
      const double lt = lse64(t), ls = lse64(s);
      const RowNorm nt = row_norm(stream(t, 0, K)), ns = row_norm(stream(s, 0, K));
      CHECK_NEAR(nt.max + nt.log_sum, lt, 1e-6 * (1 + std::fabs(lt)));

      // merging partial states in any split equals one stream (threads, lanes, chunks)
      const OnlineLSE merged = lse_merge(stream(t, 0, K / 3), stream(t, K / 3, K));
      CHECK_NEAR(merged.max + std::log(merged.sum), lt, 1e-6 * (1 + std::fabs(lt)));
      const OnlineLSE with_empty = lse_merge(lse_empty(), stream(t, 0, K));
      CHECK(with_empty.max == stream(t, 0, K).max);

      double kl = 0, kl64 = 0, grad_sum = 0, grad_err = 0;
      for (int k = 0; k < K; ++k) {
        kl += kl_term(t[k], s[k], nt, ns);
        const double lp = t[k] - lt, lq = s[k] - ls;
        kl64 += std::exp(lp) * (lp - lq);
        const double g = kl_student_grad(t[k], s[k], nt, ns);
        grad_sum += g;
        grad_err = std::fmax(grad_err, std::fabs(g - (std::exp(lq) - std::exp(lp))));
      }
      CHECK(kl64 >= -1e-9);
      CHECK_NEAR(kl, kl64, 1e-4 * (1 + std::fabs(kl64)));  // the 1e4 case needs (x - max) - log sum
      CHECK_NEAR(grad_sum, 0.0, 1e-5);                     // q and p both sum to 1
      CHECK(grad_err < 1e-6);

      // max-then-sum folding in blocks of 4, the tail padded with -inf (as the CUDA lanes do)
      OnlineLSE blocks = lse_empty();
      for (int k0 = 0; k0 < K; k0 += 4) {
        float x[4];
        for (int j = 0; j < 4; ++j) x[j] = k0 + j < K ? t[k0 + j] : -INFINITY;
        blocks = lse_push_n(blocks, x);
      }
      const RowNorm nb = row_norm(blocks);
      CHECK_NEAR(nb.max + nb.log_sum, lt, 1e-6 * (1 + std::fabs(lt)));

      // the one-read form: KL from three sums, the gradient from the kept exps
      float max_t = -INFINITY, max_s = -INFINITY;
      for (int k = 0; k < K; ++k) max_t = std::fmax(max_t, t[k]), max_s = std::fmax(max_s, s[k]);
      KlSums sums = kl_sums_empty();
      std::vector<float> e_t(K), e_s(K);
      for (int k = 0; k < K; ++k) {
        e_t[k] = std::exp(t[k] - max_t), e_s[k] = std::exp(s[k] - max_s);
        kl_sums_add(sums, t[k] - max_t, s[k] - max_s, e_t[k], e_s[k]);
      }
      CHECK_NEAR(kl_from_sums(sums, max_t), kl64, 1e-4 * (1 + std::fabs(kl64)));
      double sums_grad_err = 0;
      for (int k = 0; k < K; ++k) {
        const double g = e_s[k] / sums.sum_s - e_t[k] / sums.sum_t;
        sums_grad_err = std::fmax(sums_grad_err, std::fabs(g - (std::exp(s[k] - ls) - std::exp(t[k] - lt))));
      }
      CHECK(sums_grad_err < 1e-6);

      double self = 0;  // KL(p || p) = 0
      for (int k = 0; k < K; ++k) self += kl_term(t[k], t[k], nt, nt);
      CHECK_NEAR(self, 0.0, 1e-6);
    }
  }
  // a -inf logit has p = 0 and contributes nothing (0 log 0 = 0)
  const RowNorm n = row_norm(lse_push(lse_push(lse_empty(), -INFINITY), 0.0f));
  CHECK(kl_term(-INFINITY, -INFINITY, n, n) == 0.0f);
  CHECK_NEAR(n.max + n.log_sum, 0.0, 0.0);

  // the one-read form's edge cases: p_k = 0 where log q_k = -inf adds 0; a -inf
  // student logit under p_k > 0 makes the KL +inf; a teacher row of -inf has KL 0
  KlSums a = kl_sums_empty();
  kl_sums_add(a, 0.0f, 0.0f, 1.0f, 1.0f);
  kl_sums_add(a, -INFINITY, -INFINITY, 0.0f, 0.0f);
  CHECK(kl_from_sums(a, 0.0f) == 0.0f);
  kl_sums_add(a, -1.0f, -INFINITY, std::exp(-1.0f), 0.0f);
  CHECK(std::isinf(kl_from_sums(a, 0.0f)) && kl_from_sums(a, 0.0f) > 0);
  const float all_inf[3] = {-INFINITY, -INFINITY, -INFINITY};
  const OnlineLSE none = lse_push_n(lse_empty(), all_inf);
  CHECK(none.max == -INFINITY && none.sum == 0.0f);
  KlSums b = kl_sums_empty();
  kl_sums_add(b, NAN, 0.0f, NAN, 1.0f);  // shifted by a -inf max: (-inf) - (-inf)
  CHECK(kl_from_sums(b, -INFINITY) == 0.0f);
  // the streamed form's: a teacher row of -inf has a -inf normaliser, so its terms are NaN and the
  // kernels take its KL (0) from teacher_row_empty instead (the streamed CUDA one once summed them)
  const RowNorm empty = row_norm(lse_push_n(lse_empty(), all_inf));
  CHECK(std::isnan(kl_term(-INFINITY, 0.0f, empty, n)));
  CHECK(teacher_row_empty(empty.max) && !teacher_row_empty(n.max));
  return g_failures;
}
