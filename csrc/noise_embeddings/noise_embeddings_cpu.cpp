// CPU kernels of noise_embeddings: one pass over the output, rows in parallel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/cpu_vec.h"
#include "noise_embeddings.h"
#include "noise_embeddings_args.h"

namespace vqlcmd {
namespace {

using cpu::Vec;

// z[r] = alpha[b] * table[rows[r]] + sigma[b] * eps[r], eps given or drawn (philox.h).
template <typename table_t, typename noise_t>
void forward_rows(const NoiseArgs& a, const noise_t* noise, uint64_t seed, uint64_t offset, table_t* out) {
  const int64_t* rows = a.rows.data_ptr<int64_t>();
  const table_t* table = a.table.data_ptr<table_t>();
  const float* alpha = a.alpha.data_ptr<float>();
  const float* sigma = a.sigma.data_ptr<float>();
  const int64_t D = a.D;
  at::parallel_for(0, a.B * a.M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> ebuf(D), nbuf(D), obuf(D), scratch;
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t row = rows[r];
      TORCH_CHECK_INDEX(row_in_range(row, a.V), "noise_embeddings: token id ", row,
                        " outside the table's rows [0, ", a.V, ")");
      const float* e = cpu::row_as_float(table + row * D, ebuf.data(), D);
      const float* eps;
      if (noise != nullptr) {
        eps = cpu::row_as_float(noise + r * D, nbuf.data(), D);
      } else {
        cpu::philox_normals(seed, offset, static_cast<uint64_t>(r * D), D, nbuf.data(), scratch);
        eps = nbuf.data();
      }
      const int64_t b = r / a.M;
      const float al = alpha[b], si = sigma[b];
      float* o = cpu::out_row(out + r * D, obuf.data());
      const Vec va(al), vs(si);
      int64_t d = 0;
      for (; d + Vec::size() <= D; d += Vec::size()) {
        at::vec::fmadd(va, Vec::loadu(e + d), vs * Vec::loadu(eps + d)).store(o + d);
      }
      for (; d < D; ++d) o[d] = noise_embedding(e[d], eps[d], al, si);
      cpu::store_row(o, out + r * D, D);
    }
  });
}

at::Tensor noise_embeddings_cpu(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& alpha,
                                const at::Tensor& sigma, const std::optional<at::Tensor>& noise,
                                const std::optional<at::Tensor>& drop_mask, int64_t mask_index, int64_t seed,
                                int64_t offset, const std::optional<at::Tensor>& seed_tensor) {
  const NoiseArgs a = noise_args(tokens, table, alpha, sigma, noise, drop_mask, mask_index);
  check_seed_tensor(seed_tensor, table);
  if (seed_tensor.has_value()) seed = *seed_tensor->data_ptr<int64_t>();  // a CPU tensor: no item() dispatch
  at::Tensor out = at::empty({a.B, a.M, a.D}, table.options());
  if (out.numel() == 0) return out;
  VQLCMD_DISPATCH_FLOAT(table.scalar_type(), "noise_embeddings_cpu", [&] {
    using table_t = scalar_t;
    if (a.noise.has_value()) {
      VQLCMD_DISPATCH_FLOAT(a.noise->scalar_type(), "noise_embeddings_cpu", [&] {
        forward_rows<table_t, scalar_t>(a, a.noise->data_ptr<scalar_t>(), 0, 0, out.data_ptr<table_t>());
      });
    } else {
      forward_rows<table_t, float>(a, nullptr, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                   out.data_ptr<table_t>());
    }
  });
  return out;
}

// d z / d table[v] = sum over tokens reading row v of alpha[b] * grad[r]. Threads
// own disjoint column ranges and visit rows in order, so the sum has no races
// and one fixed order: the CPU backward is always deterministic.
template <typename grad_t>
void backward_columns(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& alpha, int64_t M,
                      int64_t V, at::Tensor& out) {
  const grad_t* g = grad.data_ptr<grad_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const float* al = alpha.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t N = rows.numel(), D = out.size(1);
  at::parallel_for(0, D, 16, [&](int64_t c0, int64_t c1) {
    const int64_t width = c1 - c0;
    std::vector<float> gbuf(width);
    for (int64_t r = 0; r < N; ++r) {
      const int64_t row = rw[r];
      TORCH_CHECK_INDEX(row_in_range(row, V), "noise_embeddings backward: token id ", row, " outside [0, ", V, ")");
      const float* gr = cpu::row_as_float(g + r * D + c0, gbuf.data(), width);
      float* dst = o + row * D + c0;
      const Vec va(al[r / M]);
      int64_t d = 0;
      for (; d + Vec::size() <= width; d += Vec::size()) {
        at::vec::fmadd(va, Vec::loadu(gr + d), Vec::loadu(dst + d)).store(dst + d);
      }
      for (; d < width; ++d) dst[d] += al[r / M] * gr[d];
    }
  });
}

// Returns the table gradient in float32 (V, D); the caller casts to the table's dtype.
at::Tensor noise_embeddings_backward_cpu(const at::Tensor& grad, const at::Tensor& tokens,
                                         const std::optional<at::Tensor>& drop_mask, int64_t mask_index,
                                         const at::Tensor& alpha, int64_t num_rows, bool deterministic) {
  (void)deterministic;  // always deterministic on CPU (see backward_columns)
  check_float_kind(grad, "grad");
  check_backward_devices(grad, tokens, drop_mask, alpha);
  const at::Tensor rows = token_rows(tokens, drop_mask, mask_index);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == tokens.size(0) && grad.size(1) == tokens.size(1),
              "grad must be (B, M, D), got ", grad.sizes());
  const int64_t D = grad.size(2);
  at::Tensor out = at::zeros({num_rows, D}, grad.options().dtype(at::kFloat));
  if (rows.numel() == 0 || D == 0) return out;
  const at::Tensor g = grad.contiguous();
  const at::Tensor al = per_batch(alpha, tokens.size(0), "alpha");
  VQLCMD_DISPATCH_FLOAT(g.scalar_type(), "noise_embeddings_backward_cpu", [&] {
    backward_columns<scalar_t>(g, rows, al, tokens.size(1), num_rows, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) {
  m.impl("noise_embeddings", &noise_embeddings_cpu);
  m.impl("noise_embeddings_backward", &noise_embeddings_backward_cpu);
}

}  // namespace vqlcmd
