// Per-element math of noise_embeddings and ddim_teacher_step (torch-free), shared
// by the CPU and CUDA kernels.
#pragma once

#include <cstdint>

#include "../common/host_device.h"

namespace vqlcmd {

// The table row a token reads: random dropping (docs/method.md §4)
// replaces a dropped token by the [mask] row.
VQLCMD_HD int64_t noised_row(int64_t token, bool dropped, int64_t mask_index) {
  return dropped ? mask_index : token;
}

// Forward process, docs/method.md eq. 6: z_t = alpha_t E[x'] + sigma_t eps.
VQLCMD_HD float noise_embedding(float e, float eps, float alpha, float sigma) {
  return alpha * e + sigma * eps;
}

// True for an id that indexes a table of `rows` rows; kernels never read outside.
VQLCMD_HD bool row_in_range(int64_t row, int64_t rows) { return row >= 0 && row < rows; }

}  // namespace vqlcmd
