// CUDA kernels of noise_embeddings. Forward: each thread owns one Philox block,
// i.e. four consecutive output elements, so drawn noise costs no memory traffic.
// Backward: scatter-add with atomics into the table in memory, or a sorted segment
// sum when torch.use_deterministic_algorithms(True) asks for a fixed order.
#include <torch/library.h>

#include "../common/cuda_utils.cuh"
#include "../common/philox.h"
#include "noise_embeddings.h"
#include "noise_embeddings_args.h"

namespace vqlcmd {
namespace {

using cuda::Pack4;

// The table row of token r: [mask] where dropped, else its id (token_ids in dispatch.h).
__device__ __forceinline__ int64_t token_row(const int64_t* __restrict__ ids, const bool* __restrict__ drop,
                                             int64_t mask_index, int64_t r) {
  return drop != nullptr && drop[r] ? mask_index : ids[r];
}

struct FwdParams {
  const int64_t* ids;
  const bool* drop;  // nullptr: no dropping
  int64_t mask_index;
  const float* alpha;
  const float* sigma;
  int64_t N, M, D, V;
  uint64_t seed, offset;
  const int64_t* seed_ptr;  // replaces seed when set: read on the device (CUDA-graph replays)
  int* bad;
};

// kPacked: D % 4 == 0 and aligned pointers, so a thread's four elements lie in
// one row and move as one Pack4.
template <typename table_t, typename noise_t, bool kDraw, bool kPacked>
__global__ void noise_forward_kernel(FwdParams p, const table_t* __restrict__ table,
                                     const noise_t* __restrict__ noise, table_t* __restrict__ out) {
  const int64_t total = p.N * p.D;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint64_t seed = p.seed;
  if constexpr (kDraw) {
    if (p.seed_ptr != nullptr) seed = static_cast<uint64_t>(*p.seed_ptr);
  }
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; 4 * q < total; q += stride) {
    float eps[4];
    if constexpr (kDraw) {
      const Philox4 r = philox_block(seed, p.offset, static_cast<uint64_t>(q));
      box_muller(r.x[0], r.x[1], &eps[0], &eps[1]);
      box_muller(r.x[2], r.x[3], &eps[2], &eps[3]);
    }
    const int64_t n0 = 4 * q;
    if constexpr (kPacked) {
      const int64_t r = n0 / p.D, d = n0 - r * p.D;
      const int64_t row = token_row(p.ids, p.drop, p.mask_index, r);
      const bool ok = row_in_range(row, p.V);
      if (!ok && p.bad) *p.bad = 1;
      Pack4<table_t> e{}, z;
      if (ok) e = *reinterpret_cast<const Pack4<table_t>*>(table + row * p.D + d);
      if constexpr (!kDraw) {
        const Pack4<noise_t> nz = *reinterpret_cast<const Pack4<noise_t>*>(noise + n0);
#pragma unroll
        for (int j = 0; j < 4; ++j) eps[j] = static_cast<float>(nz.v[j]);
      }
      const int64_t b = r / p.M;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float ej = ok ? static_cast<float>(e.v[j]) : NAN;
        z.v[j] = static_cast<table_t>(noise_embedding(ej, eps[j], p.alpha[b], p.sigma[b]));
      }
      *reinterpret_cast<Pack4<table_t>*>(out + n0) = z;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + j;
        if (n >= total) break;
        const int64_t r = n / p.D, d = n - r * p.D;
        const int64_t row = token_row(p.ids, p.drop, p.mask_index, r);
        const bool ok = row_in_range(row, p.V);
        if (!ok && p.bad) *p.bad = 1;
        const float e = ok ? static_cast<float>(table[row * p.D + d]) : NAN;
        const float ep = kDraw ? eps[j] : static_cast<float>(noise[n]);
        const int64_t b = r / p.M;
        out[n] = static_cast<table_t>(noise_embedding(e, ep, p.alpha[b], p.sigma[b]));
      }
    }
  }
}

template <typename table_t, typename noise_t, bool kDraw>
void launch_forward(const FwdParams& p, const table_t* table, const noise_t* noise, table_t* out) {
  const bool packed = p.D % 4 == 0 && cuda::aligned4(table) && cuda::aligned4(out) &&
                      (kDraw || cuda::aligned4(noise));
  const int blocks = cuda::blocks_for((p.N * p.D + 3) / 4);
  const cudaStream_t stream = cuda::current_stream();
  if (packed) {
    noise_forward_kernel<table_t, noise_t, kDraw, true><<<blocks, cuda::kThreads, 0, stream>>>(p, table, noise, out);
  } else {
    noise_forward_kernel<table_t, noise_t, kDraw, false><<<blocks, cuda::kThreads, 0, stream>>>(p, table, noise, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor noise_embeddings_cuda(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& alpha,
                                 const at::Tensor& sigma, const std::optional<at::Tensor>& noise,
                                 const std::optional<at::Tensor>& drop_mask, int64_t mask_index, int64_t seed,
                                 int64_t offset, const std::optional<at::Tensor>& seed_tensor) {
  const c10::cuda::CUDAGuard guard(cuda::op_device(table, "table"));
  // the kernel picks each token's row itself (no where/fill launches before it)
  const NoiseArgs a = noise_args(tokens, table, alpha, sigma, noise, drop_mask, mask_index, /*with_rows=*/false);
  check_seed_tensor(seed_tensor, table);
  at::Tensor out = at::empty({a.B, a.M, a.D}, table.options());
  if (out.numel() == 0) return out;
  cuda::BadIdFlag bad(table.device());
  const FwdParams p{a.ids.ids_ptr(), a.ids.drop_ptr(), a.ids.mask_index, a.alpha.data_ptr<float>(), a.sigma.data_ptr<float>(),
                    a.B * a.M, a.M, a.D, a.V, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                    seed_tensor.has_value() ? seed_tensor->data_ptr<int64_t>() : nullptr, bad.ptr()};
  VQLCMD_DISPATCH_FLOAT(table.scalar_type(), "noise_embeddings_cuda", [&] {
    using table_t = scalar_t;
    if (a.noise.has_value()) {
      VQLCMD_DISPATCH_FLOAT(a.noise->scalar_type(), "noise_embeddings_cuda", [&] {
        launch_forward<table_t, scalar_t, false>(p, a.table.data_ptr<table_t>(), a.noise->data_ptr<scalar_t>(),
                                                 out.data_ptr<table_t>());
      });
    } else {
      launch_forward<table_t, float, true>(p, a.table.data_ptr<table_t>(), nullptr, out.data_ptr<table_t>());
    }
  });
  bad.check("noise_embeddings", a.V);
  return out;
}

// Fast backward: a thread adds the gradients of kTokensPerThread consecutive
// tokens to the table for kPack consecutive columns, summing tokens of one row
// in registers first. Atomics on one address serialise in L2, and dropping sends
// a fifth or so of all tokens to the [mask] row (H200, 16384 tokens, D = 256:
// 9.5 us without dropping, 26 us with 20% dropped when every chunk added its own
// [mask] sum, 13.5 us now). So that row (hot_row) is summed per block in shared
// memory and added to the table once per block. The order of the additions (and
// so the last bits of the sum) varies from run to run.
constexpr int kTokensPerThread = 8;
constexpr int kMaxHotRowFloats = 12 * 1024;  // 48 KiB of shared memory

// out[0:4] += v: on sm_90 one vector atomic, a quarter of the L2 atomic
// operations of scalar ones; p is 16-byte aligned.
__device__ __forceinline__ void atomic_add(float* p, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
#else
#pragma unroll
  for (int j = 0; j < 4; ++j) atomicAdd(p + j, v[j]);
#endif
}

__device__ __forceinline__ void atomic_add(float* p, const float (&v)[1]) { atomicAdd(p, v[0]); }

// A thread's chunk of kTokensPerThread consecutive tokens from r0, for columns [d, d + kPack):
// g = alpha[batch] * grad, and row = the table row to add it to, or -1 for nothing (a token at or
// past `end`, or a bad id, which raises *bad). Every gradient load is issued before the ids, and
// the ids before the first is used, so all of them are in flight at once.
template <typename grad_t, int kPack>
__device__ __forceinline__ void load_chunk(const grad_t* __restrict__ grad, const int64_t* __restrict__ ids,
                                           const bool* __restrict__ drop, int64_t mask_index,
                                           const float* __restrict__ alpha, int64_t r0, int64_t end, int64_t M,
                                           int64_t D, int64_t V, int64_t d, int* bad,
                                           float (&g)[kTokensPerThread][kPack], int64_t (&row)[kTokensPerThread]) {
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    if (r0 + i < end) {
      cuda::load<kPack>(grad + (r0 + i) * D + d, g[i]);
    } else {
#pragma unroll
      for (int j = 0; j < kPack; ++j) g[i][j] = 0.0f;
    }
  }
  float scale[kTokensPerThread];
  int64_t b = r0 / M, m = r0 - b * M;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    const bool in = r0 + i < end;
    row[i] = in ? token_row(ids, drop, mask_index, r0 + i) : -1;
    scale[i] = in ? alpha[b] : 0.0f;
    if (++m == M) {  // the next token starts batch b + 1
      m = 0;
      ++b;
    }
  }
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    if (r0 + i < end && !row_in_range(row[i], V)) {
      if (bad) *bad = 1;
      row[i] = -1;
    }
#pragma unroll
    for (int j = 0; j < kPack; ++j) g[i][j] *= scale[i];
  }
}

// Adds into token i's gradient those of the later tokens of its chunk with the same row, whose rows
// become -1: one atomic for each distinct row.
template <int kPack>
__device__ __forceinline__ void merge_equal_rows(int i, float (&g)[kTokensPerThread][kPack],
                                                 int64_t (&row)[kTokensPerThread]) {
#pragma unroll
  for (int k = i + 1; k < kTokensPerThread; ++k) {
    if (row[k] != row[i]) continue;
#pragma unroll
    for (int j = 0; j < kPack; ++j) g[i][j] += g[k][j];
    row[k] = -1;
  }
}

// hot_row: -1, or a row whose sum is kept in shared memory (D floats).
// Bound by the L2's atomic units rather than memory, but a backward that summed into slices of
// the table in shared memory instead lost on an H200 (16384 tokens, D = 256, fp32 fwd+bwd: 43.2 us
// with its own row splits, 59.8 in one, against 26.9; benchmarks/results/h200-2026-11-28.jsonl),
// so it was deleted.
template <typename grad_t, int kPack>
__global__ void noise_backward_atomic_kernel(const grad_t* __restrict__ grad, const int64_t* __restrict__ ids,
                                             const bool* __restrict__ drop, int64_t mask_index,
                                             const float* __restrict__ alpha, float* __restrict__ out, int64_t N,
                                             int64_t M, int64_t D, int64_t V, int64_t hot_row, int* bad) {
  extern __shared__ float hot[];
  if (hot_row >= 0) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) hot[d] = 0.0f;
    __syncthreads();
  }
  const int64_t packs = D / kPack, chunks = (N + kTokensPerThread - 1) / kTokensPerThread;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < chunks * packs; q += stride) {
    const int64_t chunk = q / packs, d = (q - chunk * packs) * kPack, r0 = chunk * kTokensPerThread;
    float g[kTokensPerThread][kPack];
    int64_t row[kTokensPerThread];  // -1: nothing to add (past N, a bad id, or merged)
    load_chunk<grad_t, kPack>(grad, ids, drop, mask_index, alpha, r0, N, M, D, V, d, bad, g, row);
#pragma unroll
    for (int i = 0; i < kTokensPerThread; ++i) {
      if (row[i] < 0) continue;
      merge_equal_rows<kPack>(i, g, row);
      if (row[i] == hot_row) {
#pragma unroll
        for (int j = 0; j < kPack; ++j) atomicAdd(hot + d + j, g[i][j]);
      } else {
        atomic_add(out + row[i] * D + d, g[i]);
      }
    }
  }
  if (hot_row >= 0) {
    __syncthreads();
    for (int64_t d = static_cast<int64_t>(threadIdx.x) * kPack; d < D; d += static_cast<int64_t>(blockDim.x) * kPack) {
      float v[kPack];
#pragma unroll
      for (int j = 0; j < kPack; ++j) v[j] = hot[d + j];
      atomic_add(out + hot_row * D + d, v);
    }
  }
}

// Deterministic backward, two passes in one fixed order over the token positions
// sorted by row (stable):
// 1. the sorted positions in segments of kSegment: each (segment, column) sums, in
//    order, the pieces of the runs of equal rows that fall in its segment, into
//    pieces[position where the piece starts];
// 2. the block at the start of each run adds that run's pieces in order (its first
//    piece, then one at each segment start inside the run) and is the only writer
//    of its output row.
// Dropping sends about a fifth of all tokens to the [mask] row: summed by one block
// in one pass, that run took 1.3 ms (H200, 16384 tokens, D = 256); in two it costs
// about run / kSegment dependent additions after a pass that is fully parallel.
constexpr int kSegment = 32;

template <typename grad_t>
__global__ void noise_backward_pieces_kernel(const grad_t* __restrict__ grad, const int64_t* __restrict__ sorted,
                                             const int64_t* __restrict__ order, const float* __restrict__ alpha,
                                             float* __restrict__ pieces, int64_t N, int64_t M, int64_t D) {
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kSegment;
  const int64_t s1 = s0 + kSegment < N ? s0 + kSegment : N;
  for (int64_t d = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; d < D;
       d += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    float acc = 0.0f;
    int64_t start = s0;
    for (int64_t j = s0; j < s1; ++j) {
      const int64_t r = order[j];
      acc += alpha[r / M] * static_cast<float>(grad[r * D + d]);
      if (j + 1 == s1 || sorted[j + 1] != sorted[j]) {  // the piece ends here
        pieces[start * D + d] = acc;
        acc = 0.0f;
        start = j + 1;
      }
    }
  }
}

__global__ void noise_backward_runs_kernel(const int64_t* __restrict__ sorted, const float* __restrict__ pieces,
                                           float* __restrict__ out, int64_t N, int64_t D, int64_t V, int* bad) {
  const int64_t i = blockIdx.x;
  const int64_t row = sorted[i];
  if (i > 0 && sorted[i - 1] == row) return;  // not the start of a run
  if (!row_in_range(row, V)) {
    if (threadIdx.x == 0 && bad) *bad = 1;
    return;
  }
  const int64_t next_segment = (i / kSegment + 1) * kSegment;
  for (int64_t d = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; d < D;
       d += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    float acc = pieces[i * D + d];
    // sorted by row: a later segment start holding this row lies inside the run
    for (int64_t p = next_segment; p < N && sorted[p] == row; p += kSegment) acc += pieces[p * D + d];
    out[row * D + d] = acc;
  }
}

// At most one item per thread; with a hot row also at most kHotBlocksPerSm
// blocks per multiprocessor, as each block ends with D / kPack atomics on that
// row. H200, 16384 tokens, D = 256, 20% dropped: 15.8 us at 4 or more blocks
// per SM (one item per thread), 14.0 at 3, 13.5 at 2, 15.5 at 1.
constexpr int kHotBlocksPerSm = 2;

int atomic_backward_blocks(int64_t items, bool hot) {
  int blocks = cuda::blocks_for(items);
  if (hot) blocks = std::min(blocks, cuda::multiprocessors() * kHotBlocksPerSm);
  return blocks;
}

at::Tensor noise_embeddings_backward_cuda(const at::Tensor& grad, const at::Tensor& tokens,
                                          const std::optional<at::Tensor>& drop_mask, int64_t mask_index,
                                          const at::Tensor& alpha, int64_t num_rows, bool deterministic) {
  const c10::cuda::CUDAGuard guard(cuda::op_device(grad, "grad"));
  check_float_kind(grad, "grad");
  check_backward_devices(grad, tokens, drop_mask, alpha);
  check_token_inputs(tokens, drop_mask, mask_index);
  // the atomic kernel picks each token's row itself; the sorted one sorts the rows
  // (token_rows), so it needs no flat ids
  const TokenIds ids = deterministic ? TokenIds{} : token_ids(tokens, drop_mask, mask_index);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == tokens.size(0) && grad.size(1) == tokens.size(1),
              "grad must be (B, M, D), got ", grad.sizes());
  const int64_t N = tokens.numel(), M = tokens.size(1), D = grad.size(2);
  const at::Tensor g = grad.contiguous();
  // four columns move as one Pack4 (out is a fresh allocation, so aligned)
  const bool packed = D % 4 == 0 && reinterpret_cast<uintptr_t>(g.data_ptr()) % (4 * g.element_size()) == 0;
  at::Tensor out = at::zeros({num_rows, D}, grad.options().dtype(at::kFloat));
  if (N == 0 || D == 0) return out;
  const at::Tensor al = per_batch(alpha, tokens.size(0), "alpha");
  cuda::BadIdFlag bad(grad.device());
  const cudaStream_t stream = cuda::current_stream();
  const int64_t hot_row = drop_mask.has_value() && row_in_range(mask_index, num_rows) ? mask_index : -1;
  VQLCMD_DISPATCH_FLOAT(g.scalar_type(), "noise_embeddings_backward_cuda", [&] {
    if (deterministic) {
      const auto [sorted, order] =
          at::sort(token_rows(tokens, drop_mask, mask_index), /*stable=*/true, /*dim=*/0, /*descending=*/false);
      // every position pass 2 reads is a piece start that pass 1 wrote: no zero-fill
      const at::Tensor pieces = at::empty({N, D}, grad.options().dtype(at::kFloat));
      const auto column_blocks = static_cast<unsigned>(std::min<int64_t>((D + 127) / 128, 65535));
      const dim3 segments(static_cast<unsigned>((N + kSegment - 1) / kSegment), column_blocks);
      noise_backward_pieces_kernel<scalar_t><<<segments, 128, 0, stream>>>(
          g.data_ptr<scalar_t>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), al.data_ptr<float>(),
          pieces.data_ptr<float>(), N, M, D);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      noise_backward_runs_kernel<<<dim3(static_cast<unsigned>(N), column_blocks), 128, 0, stream>>>(
          sorted.data_ptr<int64_t>(), pieces.data_ptr<float>(), out.data_ptr<float>(), N, D, num_rows, bad.ptr());
    } else {
      const scalar_t* gp = g.data_ptr<scalar_t>();
      float* op = out.data_ptr<float>();
      const int64_t chunks = (N + kTokensPerThread - 1) / kTokensPerThread;
      const bool hot = hot_row >= 0 && D <= kMaxHotRowFloats;
      const size_t smem = hot ? D * sizeof(float) : 0;
      const int blocks = atomic_backward_blocks(chunks * (packed ? D / 4 : D), hot);
      if (packed) {
        noise_backward_atomic_kernel<scalar_t, 4><<<blocks, cuda::kThreads, smem, stream>>>(
            gp, ids.ids_ptr(), ids.drop_ptr(), ids.mask_index, al.data_ptr<float>(), op, N, M, D, num_rows,
            hot ? hot_row : -1, bad.ptr());
      } else {
        noise_backward_atomic_kernel<scalar_t, 1><<<blocks, cuda::kThreads, smem, stream>>>(
            gp, ids.ids_ptr(), ids.drop_ptr(), ids.mask_index, al.data_ptr<float>(), op, N, M, D, num_rows,
            hot ? hot_row : -1, bad.ptr());
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  bad.check("noise_embeddings backward", num_rows);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CUDA, m) {
  m.impl("noise_embeddings", &noise_embeddings_cuda);
  m.impl("noise_embeddings_backward", &noise_embeddings_backward_cuda);
}

}  // namespace vqlcmd
