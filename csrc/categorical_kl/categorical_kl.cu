// CUDA kernels of categorical_kl: one warp per row. Pass 1 streams the teacher
// and student rows once, each lane keeping an online log-sum-exp that the warp
// merges with shuffles; pass 2 reads the rows a second time for the KL sum and
// the student gradient. Two reads of each row, float32 math for any input dtype.
#include <torch/library.h>

#include "../common/cuda_utils.cuh"
#include "categorical_kl.h"
#include "categorical_kl_args.h"

namespace vqlcmd {
namespace {

using cuda::Pack4;

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = cuda::kThreads / kWarp;

__device__ __forceinline__ OnlineLSE warp_lse(OnlineLSE s) {
#pragma unroll
  for (int delta = kWarp / 2; delta > 0; delta /= 2) {
    const OnlineLSE other{__shfl_xor_sync(0xffffffffu, s.max, delta), __shfl_xor_sync(0xffffffffu, s.sum, delta)};
    s = lse_merge(s, other);
  }
  return s;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int delta = kWarp / 2; delta > 0; delta /= 2) x += __shfl_xor_sync(0xffffffffu, x, delta);
  return x;
}

// kPack elements per lane per step: 4 (one Pack4 load) when K % 4 == 0 and aligned.
template <int kPack, typename T>
__device__ __forceinline__ void load(const T* p, float (&v)[kPack]) {
  if constexpr (kPack == 4) {
    const Pack4<T> x = *reinterpret_cast<const Pack4<T>*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = static_cast<float>(x.v[j]);
  } else {
    v[0] = static_cast<float>(*p);
  }
}

template <int kPack, typename T>
__device__ __forceinline__ void store(T* p, const float (&v)[kPack]) {
  if constexpr (kPack == 4) {
    Pack4<T> x;
#pragma unroll
    for (int j = 0; j < 4; ++j) x.v[j] = static_cast<T>(v[j]);
    *reinterpret_cast<Pack4<T>*>(p) = x;
  } else {
    *p = static_cast<T>(v[0]);
  }
}

// kl (if given) and grad = grad_scale[row] * (q - p) (if given) for each row.
template <typename T, int kPack>
__global__ void kl_kernel(const T* __restrict__ teacher, const T* __restrict__ student, int64_t N, int64_t K,
                          float* __restrict__ kl, T* __restrict__ grad, const float* __restrict__ grad_scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= N) return;  // whole warps leave together, so the shuffles stay full
  const T* t = teacher + row * K;
  const T* s = student + row * K;
  OnlineLSE st = lse_empty(), ss = lse_empty();
  for (int64_t k = static_cast<int64_t>(lane) * kPack; k < K; k += kWarp * kPack) {
    float tv[kPack], sv[kPack];
    load<kPack>(t + k, tv);
    load<kPack>(s + k, sv);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      st = lse_push(st, tv[j]);
      ss = lse_push(ss, sv[j]);
    }
  }
  const RowNorm nt = row_norm(warp_lse(st)), ns = row_norm(warp_lse(ss));
  const float scale = grad_scale != nullptr ? grad_scale[row] : 1.0f;
  float acc = 0.0f;
  for (int64_t k = static_cast<int64_t>(lane) * kPack; k < K; k += kWarp * kPack) {
    float tv[kPack], sv[kPack], gv[kPack];
    load<kPack>(t + k, tv);
    load<kPack>(s + k, sv);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      if (kl != nullptr) acc += kl_term(tv[j], sv[j], nt, ns);
      gv[j] = scale * kl_student_grad(tv[j], sv[j], nt, ns);
    }
    if (grad != nullptr) store<kPack>(grad + row * K + k, gv);
  }
  if (kl != nullptr) {
    acc = warp_sum(acc);
    if (lane == 0) kl[row] = acc;
  }
}

template <typename T>
void launch(const KlArgs& a, float* kl, T* grad, const float* grad_scale) {
  const T* t = a.teacher.data_ptr<T>();
  const T* s = a.student.data_ptr<T>();
  const int blocks = static_cast<int>((a.N + kRowsPerBlock - 1) / kRowsPerBlock);
  const cudaStream_t stream = cuda::current_stream();
  if (a.K % 4 == 0 && cuda::aligned4(t) && cuda::aligned4(s) && (grad == nullptr || cuda::aligned4(grad))) {
    kl_kernel<T, 4><<<blocks, cuda::kThreads, 0, stream>>>(t, s, a.N, a.K, kl, grad, grad_scale);
  } else {
    kl_kernel<T, 1><<<blocks, cuda::kThreads, 0, stream>>>(t, s, a.N, a.K, kl, grad, grad_scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> categorical_kl_cuda(const at::Tensor& teacher, const at::Tensor& student,
                                                       bool emit_grad) {
  const c10::cuda::CUDAGuard guard(student.device());
  const KlArgs a = kl_args(teacher, student);
  at::Tensor kl = kl_output(teacher);
  at::Tensor grad = emit_grad ? at::empty(student.sizes(), a.student.options()) : at::empty({0}, a.student.options());
  if (a.N == 0) return {kl, grad.to(student.scalar_type())};
  VQLCMD_DISPATCH_FLOAT(a.student.scalar_type(), "categorical_kl_cuda", [&] {
    launch<scalar_t>(a, kl.data_ptr<float>(), emit_grad ? grad.data_ptr<scalar_t>() : nullptr, nullptr);
  });
  return {kl, grad.to(student.scalar_type())};
}

at::Tensor categorical_kl_backward_cuda(const at::Tensor& grad_kl, const at::Tensor& teacher,
                                        const at::Tensor& student) {
  const c10::cuda::CUDAGuard guard(student.device());
  const KlArgs a = kl_args(teacher, student);
  at::Tensor grad = at::empty(student.sizes(), a.student.options());
  if (a.N == 0) return grad.to(student.scalar_type());
  const at::Tensor g = grad_kl.to(at::kFloat).contiguous().view({a.N});
  VQLCMD_DISPATCH_FLOAT(a.student.scalar_type(), "categorical_kl_backward_cuda", [&] {
    launch<scalar_t>(a, nullptr, grad.data_ptr<scalar_t>(), g.data_ptr<float>());
  });
  return grad.to(student.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CUDA, m) {
  m.impl("categorical_kl", &categorical_kl_cuda);
  m.impl("categorical_kl_backward", &categorical_kl_backward_cuda);
}

}  // namespace vqlcmd
