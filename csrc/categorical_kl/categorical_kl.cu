// CUDA kernels of categorical_kl, float32 math for any input dtype.
//
// Rows of K <= 2048 (the model's vocabularies): each row is read once. A group
// of lanes holds the teacher and student rows in registers, takes both maxima
// with shuffles, one exp per element of each row, and three sums (KlSums); the
// KL follows from the sums and the gradient from the exps still in registers.
// No per-element rescaling or branches, and all of a lane's loads are issued
// before the first use, so many bytes are in flight per warp. The exps are one
// instruction each (exp_fast), so the kernel stays memory-bound.
// Longer rows: one warp per row, two reads (online log-sum-exp, then KL and
// gradient).
#include <torch/library.h>

#include "../common/cuda_utils.cuh"
#include "categorical_kl.h"
#include "categorical_kl_args.h"

namespace vqlcmd {
namespace {

using cuda::load;
using cuda::store;

constexpr int kWarp = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kMaxResidentK = 2048;
// 128 threads, not 256: blocks of 4 warps fill the register file better at the
// 100-150 registers a lane holds for K of 1024-2048.
constexpr int kResidentThreads = 128;

// exp(x) for x = logit - max <= 0 on the exp2 unit: relative error ~(2 + 1.2|x|)
// ulp (as __expf), i.e. < 2e-6 wherever p_k > 1e-9. ftz: results below 2^-126
// become 0 (p_k that small adds nothing a float32 sum could keep), and without
// it sm_90 wraps every ex2 in a compare and two multiplies; expf's range
// reduction would be most of the kernel's instructions.
__device__ __forceinline__ float exp_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// Reductions over aligned groups of kLanes lanes (xor by less than kLanes stays
// inside the group); every lane of the warp must take part.
template <int kLanes>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int delta = kLanes / 2; delta > 0; delta /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, delta));
  return x;
}

template <int kLanes>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int delta = kLanes / 2; delta > 0; delta /= 2) x += __shfl_xor_sync(kFullWarp, x, delta);
  return x;
}

__device__ __forceinline__ OnlineLSE warp_lse(OnlineLSE s) {
#pragma unroll
  for (int delta = kWarp / 2; delta > 0; delta /= 2) {
    const OnlineLSE other{__shfl_xor_sync(kFullWarp, s.max, delta), __shfl_xor_sync(kFullWarp, s.sum, delta)};
    s = lse_merge(s, other);
  }
  return s;
}

// kl (if given) and grad = grad_scale[row] * (q - p) (if given) for rows of
// K <= kLanes * kPack * kItems. kLanes lanes per row, 32 / kLanes rows per warp.
// Lane l holds packs i * kLanes + l, so each load of a group is contiguous.
// Elements past K, and rows past N, read as -inf (their exp is 0) so that every
// lane reaches the shuffles.
template <typename T, int kPack, int kItems, int kLanes>
__global__ void __launch_bounds__(kResidentThreads)
    kl_resident_kernel(const T* __restrict__ teacher, const T* __restrict__ student, int64_t N, int K,
                       float* __restrict__ kl, T* __restrict__ grad, const float* __restrict__ grad_scale) {
  const int lane = threadIdx.x % kLanes;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kResidentThreads + threadIdx.x) / kLanes;
  const bool row_ok = row < N;
  const int64_t base = row_ok ? row * K : 0;
  float tv[kItems][kPack], sv[kItems][kPack];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int k = (i * kLanes + lane) * kPack;
    if (row_ok && k < K) {
      load<kPack>(teacher + base + k, tv[i]);
      load<kPack>(student + base + k, sv[i]);
    } else {
#pragma unroll
      for (int j = 0; j < kPack; ++j) tv[i][j] = sv[i][j] = -INFINITY;
    }
  }
  float max_t = -INFINITY, max_s = -INFINITY;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      max_t = fmaxf(max_t, tv[i][j]);
      max_s = fmaxf(max_s, sv[i][j]);
    }
  }
  max_t = group_max<kLanes>(max_t);
  max_s = group_max<kLanes>(max_s);
  KlSums sums = kl_sums_empty();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float t_shift = tv[i][j] - max_t, s_shift = sv[i][j] - max_s;
      tv[i][j] = exp_fast(t_shift);
      sv[i][j] = exp_fast(s_shift);
      kl_sums_add(sums, t_shift, s_shift, tv[i][j], sv[i][j]);
    }
  }
  sums = KlSums{group_sum<kLanes>(sums.sum_t), group_sum<kLanes>(sums.sum_s), group_sum<kLanes>(sums.weighted)};
  if (!row_ok) return;
  if (kl != nullptr && lane == 0) kl[row] = kl_from_sums(sums, max_t);
  if (grad == nullptr) return;
  const float scale = grad_scale != nullptr ? grad_scale[row] : 1.0f;
  const float scale_p = scale / sums.sum_t, scale_q = scale / sums.sum_s;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int k = (i * kLanes + lane) * kPack;
    if (k >= K) break;
    float gv[kPack];
#pragma unroll
    for (int j = 0; j < kPack; ++j) gv[j] = sv[i][j] * scale_q - tv[i][j] * scale_p;  // scale * (q - p)
    store<kPack>(grad + base + k, gv);
  }
}

// Rows longer than kMaxResidentK: one warp per row, each lane folding kUnroll
// packs per step into its online log-sum-exp (lse_push_n: one rescale per step),
// then a second read of the row for the KL terms and the gradient.
constexpr int kUnroll = 4;
constexpr int kStreamRowsPerBlock = cuda::kThreads / kWarp;

template <typename T, int kPack>
__global__ void kl_stream_kernel(const T* __restrict__ teacher, const T* __restrict__ student, int64_t N, int64_t K,
                                 float* __restrict__ kl, T* __restrict__ grad, const float* __restrict__ grad_scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStreamRowsPerBlock + threadIdx.x / kWarp;
  if (row >= N) return;  // whole warps leave together, so the shuffles stay full
  const T* t = teacher + row * K;
  const T* s = student + row * K;
  constexpr int64_t kStep = kWarp * kPack;
  OnlineLSE st = lse_empty(), ss = lse_empty();
  for (int64_t k0 = static_cast<int64_t>(lane) * kPack; k0 < K; k0 += kUnroll * kStep) {
    float tv[kUnroll * kPack], sv[kUnroll * kPack];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float a[kPack], b[kPack];
      const int64_t k = k0 + u * kStep;
      if (k < K) {
        load<kPack>(t + k, a);
        load<kPack>(s + k, b);
      } else {
#pragma unroll
        for (int j = 0; j < kPack; ++j) a[j] = b[j] = -INFINITY;
      }
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        tv[u * kPack + j] = a[j];
        sv[u * kPack + j] = b[j];
      }
    }
    st = lse_push_n(st, tv);
    ss = lse_push_n(ss, sv);
  }
  const RowNorm nt = row_norm(warp_lse(st)), ns = row_norm(warp_lse(ss));
  const float scale = grad_scale != nullptr ? grad_scale[row] : 1.0f;
  float acc = 0.0f;
  for (int64_t k = static_cast<int64_t>(lane) * kPack; k < K; k += kStep) {
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
    acc = group_sum<kWarp>(acc);
    // the terms of an empty teacher row are NaN (its normaliser is -inf); its KL is 0
    if (lane == 0) kl[row] = teacher_row_empty(nt.max) ? 0.0f : acc;
  }
}

template <typename T, int kPack, int kItems, int kLanes>
void launch_resident(const T* t, const T* s, int64_t N, int64_t K, float* kl, T* grad, const float* grad_scale,
                     cudaStream_t stream) {
  static_assert(kWarp % kLanes == 0 && kLanes * kPack * kItems <= kMaxResidentK);
  const int64_t rows_per_block = kResidentThreads / kLanes;
  const int blocks = static_cast<int>((N + rows_per_block - 1) / rows_per_block);
  kl_resident_kernel<T, kPack, kItems, kLanes><<<blocks, kResidentThreads, 0, stream>>>(
      t, s, N, static_cast<int>(K), kl, grad, grad_scale);
}

template <int kPack, int kItems, int kLanes>
struct Shape {
  static constexpr int pack = kPack, items = kItems, lanes = kLanes;
};

// The smallest register-resident shape that holds K (kLanes * kPack * kItems >= K).
template <typename T>
void launch_resident(bool packed, const T* t, const T* s, int64_t N, int64_t K, float* kl, T* grad,
                     const float* grad_scale, cudaStream_t stream) {
  const auto go = [&](auto kernel_shape) {
    using Shape = decltype(kernel_shape);
    launch_resident<T, Shape::pack, Shape::items, Shape::lanes>(t, s, N, K, kl, grad, grad_scale, stream);
  };
  if (packed) {
    if (K <= 16) return go(Shape<4, 1, 4>{});
    if (K <= 64) return go(Shape<4, 1, 16>{});
    if (K <= 128) return go(Shape<4, 1, 32>{});
    if (K <= 256) return go(Shape<4, 2, 32>{});
    if (K <= 512) return go(Shape<4, 4, 32>{});
    if (K <= 1024) return go(Shape<4, 8, 32>{});
    return go(Shape<4, 16, 32>{});
  }
  if (K <= 8) return go(Shape<1, 1, 8>{});
  if (K <= 32) return go(Shape<1, 1, 32>{});
  if (K <= 128) return go(Shape<1, 4, 32>{});
  if (K <= 512) return go(Shape<1, 16, 32>{});
  return go(Shape<1, 64, 32>{});
}

template <typename T>
void launch(const KlArgs& a, float* kl, T* grad, const float* grad_scale) {
  const T* t = a.teacher.data_ptr<T>();
  const T* s = a.student.data_ptr<T>();
  const cudaStream_t stream = cuda::current_stream();
  const bool packed =
      a.K % 4 == 0 && cuda::aligned4(t) && cuda::aligned4(s) && (grad == nullptr || cuda::aligned4(grad));
  if (a.K <= kMaxResidentK) {
    launch_resident<T>(packed, t, s, a.N, a.K, kl, grad, grad_scale, stream);
  } else {
    const int blocks = static_cast<int>((a.N + kStreamRowsPerBlock - 1) / kStreamRowsPerBlock);
    if (packed) {
      kl_stream_kernel<T, 4><<<blocks, cuda::kThreads, 0, stream>>>(t, s, a.N, a.K, kl, grad, grad_scale);
    } else {
      kl_stream_kernel<T, 1><<<blocks, cuda::kThreads, 0, stream>>>(t, s, a.N, a.K, kl, grad, grad_scale);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> categorical_kl_cuda(const at::Tensor& teacher, const at::Tensor& student,
                                                       bool emit_grad) {
  const c10::cuda::CUDAGuard guard(cuda::op_device(student, "student_logits"));
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
  const c10::cuda::CUDAGuard guard(cuda::op_device(student, "student_logits"));
  const KlArgs a = kl_args(teacher, student);
  const at::Tensor g = kl_grad_rows(grad_kl, teacher, a.N);
  at::Tensor grad = at::empty(student.sizes(), a.student.options());
  if (a.N == 0) return grad.to(student.scalar_type());
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
