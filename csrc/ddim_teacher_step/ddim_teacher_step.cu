// CUDA kernel of ddim_teacher_step: one pass over z_t; each thread moves four
// consecutive elements (one Pack4 when D % 4 == 0 and the pointers allow).
#include <torch/library.h>

#include "../common/cuda_utils.cuh"
#include "../noise_embeddings/noise_embeddings.h"
#include "ddim_teacher_step.h"
#include "ddim_teacher_step_args.h"

namespace vqlcmd {
namespace {

using cuda::Pack4;

struct DdimParams {
  const int64_t* rows;
  const float* alpha_t;
  const float* alpha_s;
  const float* ratio;
  int64_t N, M, D, V;
  int* bad;
};

template <typename z_type, typename table_t, bool kPacked>
__global__ void ddim_kernel(DdimParams p, const table_t* __restrict__ table, const z_type* __restrict__ z_t,
                            z_type* __restrict__ out) {
  const int64_t total = p.N * p.D;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; 4 * q < total; q += stride) {
    const int64_t n0 = 4 * q;
    if constexpr (kPacked) {
      const int64_t r = n0 / p.D, d = n0 - r * p.D;
      const int64_t row = p.rows[r];
      const bool ok = row_in_range(row, p.V);
      if (!ok && p.bad) *p.bad = 1;
      Pack4<table_t> e{};
      if (ok) e = *reinterpret_cast<const Pack4<table_t>*>(table + row * p.D + d);
      const Pack4<z_type> z = *reinterpret_cast<const Pack4<z_type>*>(z_t + n0);
      const int64_t b = r / p.M;
      Pack4<z_type> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float ej = ok ? static_cast<float>(e.v[j]) : NAN;
        o.v[j] = static_cast<z_type>(ddim_step(ej, static_cast<float>(z.v[j]), p.alpha_t[b], p.alpha_s[b], p.ratio[b]));
      }
      *reinterpret_cast<Pack4<z_type>*>(out + n0) = o;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + j;
        if (n >= total) break;
        const int64_t r = n / p.D, d = n - r * p.D;
        const int64_t row = p.rows[r];
        const bool ok = row_in_range(row, p.V);
        if (!ok && p.bad) *p.bad = 1;
        const float e = ok ? static_cast<float>(table[row * p.D + d]) : NAN;
        const int64_t b = r / p.M;
        out[n] = static_cast<z_type>(ddim_step(e, static_cast<float>(z_t[n]), p.alpha_t[b], p.alpha_s[b], p.ratio[b]));
      }
    }
  }
}

at::Tensor ddim_teacher_step_cuda(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& z_t,
                                  const at::Tensor& alpha_t, const at::Tensor& sigma_t, const at::Tensor& alpha_s,
                                  const at::Tensor& sigma_s) {
  const c10::cuda::CUDAGuard guard(cuda::op_device(z_t, "z_t"));
  const DdimArgs a = ddim_args(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s);
  at::Tensor out = at::empty({a.B, a.M, a.D}, z_t.options());
  if (out.numel() == 0) return out;
  cuda::BadIdFlag bad(z_t.device());
  const DdimParams p{a.rows.data_ptr<int64_t>(), a.alpha_t.data_ptr<float>(), a.alpha_s.data_ptr<float>(),
                     a.ratio.data_ptr<float>(), a.B * a.M, a.M, a.D, a.V, bad.ptr()};
  const int blocks = cuda::blocks_for((p.N * p.D + 3) / 4);
  const cudaStream_t stream = cuda::current_stream();
  VQLCMD_DISPATCH_FLOAT(z_t.scalar_type(), "ddim_teacher_step_cuda", [&] {
    using z_type = scalar_t;
    VQLCMD_DISPATCH_FLOAT(table.scalar_type(), "ddim_teacher_step_cuda", [&] {
      const scalar_t* tab = a.table.data_ptr<scalar_t>();
      const z_type* z = a.z_t.data_ptr<z_type>();
      z_type* o = out.data_ptr<z_type>();
      if (p.D % 4 == 0 && cuda::aligned4(tab) && cuda::aligned4(z) && cuda::aligned4(o)) {
        ddim_kernel<z_type, scalar_t, true><<<blocks, cuda::kThreads, 0, stream>>>(p, tab, z, o);
      } else {
        ddim_kernel<z_type, scalar_t, false><<<blocks, cuda::kThreads, 0, stream>>>(p, tab, z, o);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  bad.check("ddim_teacher_step", a.V);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CUDA, m) { m.impl("ddim_teacher_step", &ddim_teacher_step_cuda); }

}  // namespace vqlcmd
