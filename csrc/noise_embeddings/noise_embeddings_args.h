// Argument preparation shared by the CPU and CUDA launchers of noise_embeddings.
#pragma once

#include "../common/dispatch.h"

namespace vqlcmd {

struct NoiseArgs {
  at::Tensor rows;   // (B*M,) int64 table row per token, after dropping (undefined when !with_rows)
  TokenIds ids;      // the ids and drop flags instead, for kernels that pick rows (when !with_rows)
  at::Tensor table;  // (V, D) contiguous
  at::Tensor alpha, sigma;  // (B,) float32
  std::optional<at::Tensor> noise;  // (B, M, D) contiguous, or drawn in the kernel
  int64_t B, M, D, V;
};

inline NoiseArgs noise_args(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& alpha,
                            const at::Tensor& sigma, const std::optional<at::Tensor>& noise,
                            const std::optional<at::Tensor>& drop_mask, int64_t mask_index,
                            bool with_rows = true) {
  check_float_kind(table, "table");
  TORCH_CHECK(table.dim() == 2, "table must be (V, D), got ", table.sizes());
  check_device(tokens, table.device(), "tokens");
  check_device(alpha, table.device(), "alpha");
  check_device(sigma, table.device(), "sigma");
  check_device(noise, table.device(), "noise");
  check_device(drop_mask, table.device(), "drop_mask");
  NoiseArgs a;
  if (with_rows) {
    a.rows = token_rows(tokens, drop_mask, mask_index);
  } else {
    a.ids = token_ids(tokens, drop_mask, mask_index);
  }
  a.B = tokens.size(0);
  a.M = tokens.size(1);
  a.V = table.size(0);
  a.D = table.size(1);
  a.table = table.contiguous();
  a.alpha = per_batch(alpha, a.B, "alpha");
  a.sigma = per_batch(sigma, a.B, "sigma");
  if (noise.has_value()) {
    check_float_kind(*noise, "noise");
    TORCH_CHECK(noise->sizes() == at::IntArrayRef({a.B, a.M, a.D}), "noise must be (B, M, D) = (", a.B, ", ",
                a.M, ", ", a.D, "), got ", noise->sizes());
    a.noise = noise->contiguous();
  }
  return a;
}

// The backward's tensors all on grad's device (see check_device).
inline void check_backward_devices(const at::Tensor& grad, const at::Tensor& tokens,
                                   const std::optional<at::Tensor>& drop_mask, const at::Tensor& alpha) {
  check_device(tokens, grad.device(), "tokens");
  check_device(drop_mask, grad.device(), "drop_mask");
  check_device(alpha, grad.device(), "alpha");
}

// seed_tensor, when given, must be one int64 on the op's device (the kernels read the seed from it).
inline void check_seed_tensor(const std::optional<at::Tensor>& seed_tensor, const at::Tensor& table) {
  if (!seed_tensor.has_value()) return;
  TORCH_CHECK(seed_tensor->scalar_type() == at::kLong && seed_tensor->numel() == 1,
              "seed_tensor must hold one int64, got ", seed_tensor->scalar_type(), " with ", seed_tensor->numel(),
              " elements");
  TORCH_CHECK(seed_tensor->device() == table.device(), "seed_tensor must be on the table's device (",
              table.device(), "), got ", seed_tensor->device());
}

}  // namespace vqlcmd
