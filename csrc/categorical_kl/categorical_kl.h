// Per-row math of categorical_kl, shared by the CPU and CUDA kernels (torch-free).
//
// L_CM of VQ-LCMD.md: KL(p || q) = sum_k p_k (log p_k - log q_k) with
// p = softmax(teacher), q = softmax(student), and d KL / d student_k = q_k - p_k.
// Two passes over a row, at most: pass 1 streams both rows once and keeps an
// online log-sum-exp (Milakov & Gimelshein 2018) for each; pass 2 reads them
// again to sum the KL terms and, optionally, write the student gradient.
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

// One KL term p_k (log p_k - log q_k); p_k = 0 contributes 0 (0 log 0 = 0), also
// when the student's log q_k is -inf there.
VQLCMD_HD float kl_term(float teacher, float student, RowNorm nt, RowNorm ns) {
  const float log_p = log_softmax_at(teacher, nt);
  const float p = expf(log_p);
  return p > 0.0f ? p * (log_p - log_softmax_at(student, ns)) : 0.0f;
}

// d KL / d student_k = q_k - p_k (the softmax cross-entropy gradient, because the
// teacher's entropy does not depend on the student).
VQLCMD_HD float kl_student_grad(float teacher, float student, RowNorm nt, RowNorm ns) {
  return expf(log_softmax_at(student, ns)) - expf(log_softmax_at(teacher, nt));
}

}  // namespace vqlcmd
