// Per-row math of categorical_kl, shared by the CPU and CUDA kernels (torch-free).
//
// L_CM of docs/method.md (eq. 13): KL(p || q) = sum_k p_k (log p_k - log q_k) with
// p = softmax(teacher), q = softmax(student), and d KL / d student_k = q_k - p_k.
// Two forms. Streamed (CPU, long rows on CUDA): pass 1 keeps an online
// log-sum-exp (Milakov & Gimelshein 2018) of each row, pass 2 reads the rows
// again to sum the KL terms and, optionally, write the student gradient.
// Register-resident (CUDA rows of K <= 2048): the rows are read once, and the KL
// follows from three sums (KlSums below).
#pragma once

#include <cmath>

#include "../common/host_device.h"

namespace vqlcmd {

// Running (max, sum of exp(x - max)) of a stream: log-sum-exp = max + log(sum).
struct OnlineLSE {
  float max;
  float sum;
};

VQLCMD_HD OnlineLSE lse_empty() { return OnlineLSE{-INFINITY, 0.0f}; }

// Folds x into the state. exp() is only taken of non-positive numbers, so logits
// of +-1e4 neither overflow nor lose the row.
VQLCMD_HD OnlineLSE lse_push(OnlineLSE s, float x) {
  if (x > s.max) return OnlineLSE{x, s.sum * expf(s.max - x) + 1.0f};  // s.max = -inf: exp(-inf) = 0
  if (x == -INFINITY) return s;  // exp(-inf - (-inf)) would be NaN
  return OnlineLSE{s.max, s.sum + expf(x - s.max)};
}

// Folds n values at once, max first: one rescale of the running sum per call
// instead of a data-dependent branch and rescale per value. Still exp() only of
// non-positive numbers; -inf values add exp(-inf) = 0.
template <int n>
VQLCMD_HD OnlineLSE lse_push_n(OnlineLSE s, const float (&x)[n]) {
  float m = s.max;
  for (int j = 0; j < n; ++j) m = fmaxf(m, x[j]);
  if (m == -INFINITY) return s;  // all -inf so far: exp(-inf - (-inf)) would be NaN
  float sum = s.sum * expf(s.max - m);
  for (int j = 0; j < n; ++j) sum += expf(x[j] - m);
  return OnlineLSE{m, sum};
}

// Combines two partial states (two threads, two vector lanes, two chunks).
VQLCMD_HD OnlineLSE lse_merge(OnlineLSE a, OnlineLSE b) {
  if (b.max == -INFINITY) return a;
  if (a.max == -INFINITY) return b;
  if (a.max >= b.max) return OnlineLSE{a.max, a.sum + b.sum * expf(b.max - a.max)};
  return OnlineLSE{b.max, b.sum + a.sum * expf(a.max - b.max)};
}

// A row's normaliser kept as (max, log sum), not as max + log(sum): with logits
// of 1e4 the float32 sum would round log(sum) ~ 1e-4 away, and p_k = exp(...)
// would be off by that much relative, times log-ratios of 2e4 in the KL.
struct RowNorm {
  float max;
  float log_sum;
};

VQLCMD_HD RowNorm row_norm(OnlineLSE s) { return RowNorm{s.max, logf(s.sum)}; }

// log softmax(x)_k = (x_k - max) - log sum, in this order (as log_softmax does).
VQLCMD_HD float log_softmax_at(float x, RowNorm n) { return (x - n.max) - n.log_sum; }

// Whether a teacher row holds no probability: every logit -inf (its max, max_t, is -inf). Each p_k is 0,
// so the row's KL is 0 (0 log 0 = 0), but its normaliser is -inf and (x - max) - log_sum is NaN: no form
// may take that row's KL from its terms (kl_term) or sums (KlSums). Each asks this first, so the CPU,
// register-resident and streamed kernels agree. The gradient q - p has no p: NaN, as the reference's.
VQLCMD_HD bool teacher_row_empty(float max_t) { return max_t == -INFINITY; }

// One KL term p_k (log p_k - log q_k); p_k = 0 contributes 0 (0 log 0 = 0), also
// when the student's log q_k is -inf there. Tested as p == 0, not p > 0: a NaN p
// (a NaN or +inf teacher logit) must make the KL NaN, not drop out of the sum.
VQLCMD_HD float kl_term(float teacher, float student, RowNorm nt, RowNorm ns) {
  const float log_p = log_softmax_at(teacher, nt);
  const float p = expf(log_p);
  return p == 0.0f ? 0.0f : p * (log_p - log_softmax_at(student, ns));
}

// d KL / d student_k = q_k - p_k (the softmax cross-entropy gradient, because the
// teacher's entropy does not depend on the student).
VQLCMD_HD float kl_student_grad(float teacher, float student, RowNorm nt, RowNorm ns) {
  return expf(log_softmax_at(student, ns)) - expf(log_softmax_at(teacher, nt));
}

// Sums of the register-resident form. With the row maxima known, each element
// pair costs two exps, e_t = exp(t - max_t) and e_s = exp(s - max_s), and
//   KL = sum_k p_k (log p_k - log q_k) = weighted / sum_t + log sum_s - log sum_t,
//   weighted = sum_k e_t,k ((t_k - max_t) - (s_k - max_s)),  sum = sum_k e_k,
// because sum_k p_k = 1. Logits meet the log-sums only after their maxima are
// subtracted, so logits of +-1e4 keep their precision (as with RowNorm).
struct KlSums {
  float sum_t, sum_s, weighted;
};

VQLCMD_HD KlSums kl_sums_empty() { return KlSums{0.0f, 0.0f, 0.0f}; }

// Adds the pair with shifted logits t - max_t, s - max_s and their exps, which the
// caller takes (and keeps: q_k - p_k = e_s / sum_s - e_t / sum_t) with the exp of
// its device.
VQLCMD_HD void kl_sums_add(KlSums& a, float t_shift, float s_shift, float e_t, float e_s) {
  a.sum_t += e_t;
  a.sum_s += e_s;
  a.weighted += e_t == 0.0f ? 0.0f : e_t * (t_shift - s_shift);  // p_k = 0 contributes 0, as in kl_term
}

VQLCMD_HD float kl_from_sums(KlSums a, float max_t) {
  if (teacher_row_empty(max_t)) return 0.0f;
  return a.weighted / a.sum_t + (logf(a.sum_s) - logf(a.sum_t));
}

}  // namespace vqlcmd
