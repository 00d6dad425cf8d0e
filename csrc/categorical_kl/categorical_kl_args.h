// Argument preparation shared by the CPU and CUDA launchers of categorical_kl.
#pragma once

#include "../common/dispatch.h"

namespace vqlcmd {

struct KlArgs {
  at::Tensor teacher, student;  // (N, K) contiguous, one dtype
  int64_t N, K;
};

// Mixed dtypes (e.g. an fp32 EMA teacher and a bf16 student) are read as float32.
inline KlArgs kl_args(const at::Tensor& teacher, const at::Tensor& student) {
  check_float_kind(teacher, "teacher_logits");
  check_float_kind(student, "student_logits");
  TORCH_CHECK(teacher.dim() >= 1, "logits need a class dimension");
  check_device(student, teacher.device(), "student_logits");
  TORCH_CHECK(teacher.sizes() == student.sizes(), "teacher_logits ", teacher.sizes(), " and student_logits ",
              student.sizes(), " must have one shape");
  KlArgs a;
  a.K = teacher.size(-1);
  a.N = a.K == 0 ? 0 : teacher.numel() / a.K;
  const bool same = teacher.scalar_type() == student.scalar_type();
  a.teacher = (same ? teacher : teacher.to(at::kFloat)).contiguous().view({a.N, a.K});
  a.student = (same ? student : student.to(at::kFloat)).contiguous().view({a.N, a.K});
  return a;
}

// KL per row has the logits' leading shape, float32. Rows of K = 0 are empty sums, 0, which no kernel
// writes (kl_args makes N = 0 for them), so they are zeroed here.
inline at::Tensor kl_output(const at::Tensor& teacher) {
  const auto shape = teacher.sizes().slice(0, teacher.dim() - 1);
  const auto options = teacher.options().dtype(at::kFloat);
  return teacher.size(-1) == 0 ? at::zeros(shape, options) : at::empty(shape, options);
}

// The backward's upstream gradient as float32 (N,), one value per row (undefined when N = 0).
inline at::Tensor kl_grad_rows(const at::Tensor& grad_kl, const at::Tensor& teacher, int64_t N) {
  check_device(grad_kl, teacher.device(), "grad_kl");
  if (N == 0) return at::Tensor();
  TORCH_CHECK(grad_kl.numel() == N, "grad_kl must hold one value per row (", N, "), got ", grad_kl.numel());
  return grad_kl.to(at::kFloat).contiguous().view({N});
}

}  // namespace vqlcmd
