// Per-element math of ddim_teacher_step (torch-free), shared by CPU and CUDA.
#pragma once

#include "../common/host_device.h"

namespace vqlcmd {

// Teacher input, docs/method.md eq. 10: z_s = alpha_s e + (sigma_s / sigma_t)(z_t - alpha_t e),
// with e = E_ema[x]; written as in the reference so fp32 results agree to rounding.
VQLCMD_HD float ddim_step(float e, float z_t, float alpha_t, float alpha_s, float ratio) {
  return alpha_s * e + ratio * (z_t - alpha_t * e);
}

}  // namespace vqlcmd
