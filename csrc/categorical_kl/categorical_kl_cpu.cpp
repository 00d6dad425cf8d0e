// CPU kernels of categorical_kl: rows in parallel, each row read from memory
// once per pass and processed in float32 vector registers. exp_u20 (ATen's
// polynomial exp, relative error ~1e-6) instead of Sleef's exact one: exp is
// most of the work, and the error stays far inside the fp32 test tolerance.
#include <algorithm>
#include <limits>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/cpu_vec.h"
#include "categorical_kl.h"
#include "categorical_kl_args.h"

namespace vqlcmd {
namespace {

using cpu::Vec;

// Normaliser of a row: max, then sum of exp(x - max) over the row while it is
// still in L1; lse_push folds in the tail that does not fill a vector.
RowNorm row_lse(const float* x, int64_t K) {
  int64_t body = K - K % Vec::size();
  OnlineLSE s = lse_empty();
  if (body > 0) {
    Vec vmax = Vec::loadu(x);
    for (int64_t k = Vec::size(); k < body; k += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(x + k));
    const float m = cpu::reduce_max(vmax);
    if (m != -INFINITY) {  // all -inf: nothing to add, and exp(-inf - (-inf)) would be NaN (as in lse_push)
      const Vec vm(m);
      Vec vsum(0.0f);
      for (int64_t k = 0; k < body; k += Vec::size()) vsum = vsum + (Vec::loadu(x + k) - vm).exp_u20();
      s = OnlineLSE{m, cpu::reduce_sum(vsum)};
    }
  }
  for (int64_t k = body; k < K; ++k) s = lse_push(s, x[k]);
  return row_norm(s);
}

// KL of one row; if `grad` is given, also writes scale * (q - p) there (kl_student_grad).
float row_kl(const float* t, const float* s, int64_t K, float* grad, float scale) {
  const RowNorm nt = row_lse(t, K), ns = row_lse(s, K);
  if (teacher_row_empty(nt.max)) {  // KL 0, gradient NaN. Not left to the vector loop: exp_u20
    // takes the NaN of (-inf) - (-inf) to +inf, and inf * NaN made the KL NaN.
    if (grad != nullptr) std::fill(grad, grad + K, std::numeric_limits<float>::quiet_NaN());
    return 0.0f;
  }
  const Vec tmax(nt.max), tlog(nt.log_sum), smax(ns.max), slog(ns.log_sum), zero(0.0f), vscale(scale);
  Vec acc(0.0f);
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    const Vec log_p = (Vec::loadu(t + k) - tmax) - tlog;  // log_softmax_at
    const Vec log_q = (Vec::loadu(s + k) - smax) - slog;
    const Vec p = log_p.exp_u20();
    acc = acc + Vec::blendv(p * (log_p - log_q), zero, p == zero);  // 0 log 0 = 0; a NaN p stays NaN
    if (grad != nullptr) (vscale * (log_q.exp_u20() - p)).store(grad + k);
  }
  float kl = cpu::reduce_sum(acc);
  for (; k < K; ++k) {
    kl += kl_term(t[k], s[k], nt, ns);
    if (grad != nullptr) grad[k] = scale * kl_student_grad(t[k], s[k], nt, ns);
  }
  return kl;
}

// Rows [lo, hi): kl[r] if `kl` is given, grad rows if `grad` is given (scaled by
// grad_kl[r] when that is given: the backward pass).
template <typename T>
void kl_rows(const KlArgs& a, float* kl, T* grad, const float* grad_kl) {
  const T* teacher = a.teacher.data_ptr<T>();
  const T* student = a.student.data_ptr<T>();
  const int64_t K = a.K;
  at::parallel_for(0, a.N, std::max<int64_t>(1, 8192 / K), [&](int64_t lo, int64_t hi) {
    std::vector<float> tbuf(K), sbuf(K), gbuf(K);
    for (int64_t r = lo; r < hi; ++r) {
      const float* t = cpu::row_as_float(teacher + r * K, tbuf.data(), K);
      const float* s = cpu::row_as_float(student + r * K, sbuf.data(), K);
      float* g = grad != nullptr ? cpu::out_row(grad + r * K, gbuf.data()) : nullptr;
      const float value = row_kl(t, s, K, g, grad_kl != nullptr ? grad_kl[r] : 1.0f);
      if (kl != nullptr) kl[r] = value;
      if (g != nullptr) cpu::store_row(g, grad + r * K, K);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> categorical_kl_cpu(const at::Tensor& teacher, const at::Tensor& student,
                                                      bool emit_grad) {
  const KlArgs a = kl_args(teacher, student);
  at::Tensor kl = kl_output(teacher);
  at::Tensor grad = emit_grad ? at::empty(student.sizes(), a.student.options()) : at::empty({0}, a.student.options());
  if (a.N == 0) return {kl, grad};
  VQLCMD_DISPATCH_FLOAT(a.student.scalar_type(), "categorical_kl_cpu", [&] {
    kl_rows<scalar_t>(a, kl.data_ptr<float>(), emit_grad ? grad.data_ptr<scalar_t>() : nullptr, nullptr);
  });
  return {kl, grad.to(student.scalar_type())};
}

at::Tensor categorical_kl_backward_cpu(const at::Tensor& grad_kl, const at::Tensor& teacher,
                                       const at::Tensor& student) {
  const KlArgs a = kl_args(teacher, student);
  const at::Tensor g = kl_grad_rows(grad_kl, teacher, a.N);
  at::Tensor grad = at::empty(student.sizes(), a.student.options());
  if (a.N == 0) return grad.to(student.scalar_type());
  VQLCMD_DISPATCH_FLOAT(a.student.scalar_type(), "categorical_kl_backward_cpu", [&] {
    kl_rows<scalar_t>(a, nullptr, grad.data_ptr<scalar_t>(), g.data_ptr<float>());
  });
  return grad.to(student.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) {
  m.impl("categorical_kl", &categorical_kl_cpu);
  m.impl("categorical_kl_backward", &categorical_kl_backward_cpu);
}

}  // namespace vqlcmd
