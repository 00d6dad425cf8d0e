// The per-row math of csrc/categorical_kl/categorical_kl.h against float64
// two-pass formulas: online log-sum-exp, its merge, the KL terms and gradient.
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

      double self = 0;  // KL(p || p) = 0
      for (int k = 0; k < K; ++k) self += kl_term(t[k], t[k], nt, nt);
      CHECK_NEAR(self, 0.0, 1e-6);
    }
  }
  // a -inf logit has p = 0 and contributes nothing (0 log 0 = 0)
  const RowNorm n = row_norm(lse_push(lse_push(lse_empty(), -INFINITY), 0.0f));
  CHECK(kl_term(-INFINITY, -INFINITY, n, n) == 0.0f);
  CHECK_NEAR(n.max + n.log_sum, 0.0, 0.0);
  return g_failures;
}
