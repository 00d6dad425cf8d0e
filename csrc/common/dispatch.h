// Torch-side helpers shared by the CPU and CUDA launchers of every op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

// The kernels read fp32, bf16 and fp16 and do float32 math (docs/building.md: float32
// accumulation for low-precision inputs). float64 is served by the reference
// backend, which the dispatcher picks for it.
#define VQLCMD_DISPATCH_FLOAT(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace vqlcmd {

inline void check_float_kind(const at::Tensor& x, const char* name) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", t);
}

// The dispatcher runs the CUDA kernel when any argument is on a GPU: an argument left on the CPU (or on
// another GPU) would have its pointer read by the kernel, an illegal access that ends the CUDA context.
inline void check_device(const at::Tensor& x, const at::Device& device, const char* name) {
  TORCH_CHECK(x.device() == device, name, " must be on ", device, " with the op's other tensors, got ", x.device());
}

inline void check_device(const std::optional<at::Tensor>& x, const at::Device& device, const char* name) {
  if (x.has_value()) check_device(*x, device, name);
}

inline void check_token_inputs(const at::Tensor& tokens, const std::optional<at::Tensor>& drop_mask,
                               int64_t mask_index) {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be (B, M), got ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt,
              "tokens must be int64 or int32, got ", tokens.scalar_type());
  if (drop_mask.has_value()) {
    TORCH_CHECK(drop_mask->scalar_type() == at::kBool, "drop_mask must be bool");
    TORCH_CHECK(drop_mask->sizes() == tokens.sizes(), "drop_mask must have the shape of tokens");
    TORCH_CHECK(mask_index >= 0, "drop_mask given without mask_index");
  }
}

// Table row of each token after random dropping, flattened to (B*M,), int64.
// Range is checked by the kernels (they must never read outside the table).
inline at::Tensor token_rows(const at::Tensor& tokens, const std::optional<at::Tensor>& drop_mask,
                             int64_t mask_index) {
  check_token_inputs(tokens, drop_mask, mask_index);
  at::Tensor rows = tokens.to(at::kLong);
  // a Scalar, not a scalar tensor: on a GPU that would be one more (fill) kernel per call
  if (drop_mask.has_value()) rows = at::where(*drop_mask, at::Scalar(mask_index), rows);
  return rows.reshape({-1}).contiguous();
}

// The inputs of token_rows as flat int64 ids and bool drop flags, for kernels that
// pick each token's row themselves (row = drop[r] ? mask_index : ids[r]) and so
// save the launches that token_rows costs on a GPU.
struct TokenIds {
  at::Tensor ids;   // (B*M,) int64
  at::Tensor drop;  // (B*M,) bool, or undefined
  int64_t mask_index = -1;
  const int64_t* ids_ptr() const { return ids.data_ptr<int64_t>(); }
  const bool* drop_ptr() const { return drop.defined() ? drop.data_ptr<bool>() : nullptr; }
};

inline TokenIds token_ids(const at::Tensor& tokens, const std::optional<at::Tensor>& drop_mask,
                          int64_t mask_index) {
  check_token_inputs(tokens, drop_mask, mask_index);
  TokenIds t{tokens.to(at::kLong).reshape({-1}).contiguous(), at::Tensor(), mask_index};
  if (drop_mask.has_value()) t.drop = drop_mask->reshape({-1}).contiguous();
  return t;
}

// Per-batch coefficients (alpha, sigma, ...) as float32 (B,): tiny, so a copy is free.
inline at::Tensor per_batch(const at::Tensor& x, int64_t batch, const char* name) {
  TORCH_CHECK(x.dim() == 1 && x.size(0) == batch, name, " must have shape (", batch, ",), got ", x.sizes());
  return x.to(at::kFloat).contiguous();
}

}  // namespace vqlcmd
