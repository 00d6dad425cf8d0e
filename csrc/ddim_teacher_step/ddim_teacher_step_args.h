// Argument preparation shared by the CPU and CUDA launchers of ddim_teacher_step.
#pragma once

#include "../common/dispatch.h"

namespace vqlcmd {

struct DdimArgs {
  at::Tensor rows;   // (B*M,) int64
  at::Tensor table;  // (V, D) contiguous (the EMA table)
  at::Tensor z_t;    // (B, M, D) contiguous
  at::Tensor alpha_t, alpha_s, ratio;  // (B,) float32; ratio = sigma_s / sigma_t
  int64_t B, M, D, V;
};

inline DdimArgs ddim_args(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& z_t,
                          const at::Tensor& alpha_t, const at::Tensor& sigma_t, const at::Tensor& alpha_s,
                          const at::Tensor& sigma_s) {
  check_float_kind(table, "table");
  check_float_kind(z_t, "z_t");
  TORCH_CHECK(table.dim() == 2, "table must be (V, D), got ", table.sizes());
  check_device(tokens, table.device(), "tokens");
  check_device(z_t, table.device(), "z_t");
  check_device(alpha_t, table.device(), "alpha_t");
  check_device(sigma_t, table.device(), "sigma_t");
  check_device(alpha_s, table.device(), "alpha_s");
  check_device(sigma_s, table.device(), "sigma_s");
  DdimArgs a;
  a.rows = token_rows(tokens, std::nullopt, -1);
  a.B = tokens.size(0);
  a.M = tokens.size(1);
  a.V = table.size(0);
  a.D = table.size(1);
  TORCH_CHECK(z_t.sizes() == at::IntArrayRef({a.B, a.M, a.D}), "z_t must be (B, M, D) = (", a.B, ", ", a.M, ", ",
              a.D, "), got ", z_t.sizes());
  a.table = table.contiguous();
  a.z_t = z_t.contiguous();
  a.alpha_t = per_batch(alpha_t, a.B, "alpha_t");
  a.alpha_s = per_batch(alpha_s, a.B, "alpha_s");
  a.ratio = per_batch(sigma_s, a.B, "sigma_s") / per_batch(sigma_t, a.B, "sigma_t");
  return a;
}

}  // namespace vqlcmd
