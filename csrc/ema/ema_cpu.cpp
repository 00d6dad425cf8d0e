// CPU kernel of the EMA update (docs/method.md §9, eq. 16) over flat buffers: for each shadow k,
// θ̄_k ← θ̄_k + w_k (θ − θ̄_k) with w_k = 1 − η_k, and a 16-bit copy of a shadow where one is asked for
// (the teacher's compute weights), in one pass over the source.
//
// Why a kernel: the engine's flat step (vqlcmd/engine/flat_step.py) updates both EMAs of the
// imagenet-246m run from the bf16 weights. In ATen that is a cast of the weights to float32, a lerp_
// per EMA and a copy of the teacher's shadow into its bf16 compute copy: four passes over 2-8 bytes
// per weight, 3.6 ms a step at the preset's structure with tiny widths on a 2-core Xeon
// (benchmarks/host_overhead.py), where this pass reads each weight once. On GPUs each of those is one
// memory-bound kernel of a few microseconds, so there is no CUDA kernel (the reference serves).
//
// The rounding is torch.lerp's, bit for bit (tested): ATen's vectorised lerp computes
// fma(w, end − self, self) for |w| < 0.5 and fma(w − 1, end − self, end) otherwise.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/cpu_vec.h"
#include "../common/dispatch.h"

namespace vqlcmd {
namespace {

using cpu::Vec;

constexpr int64_t kEmaBlock = 2048;  // source elements converted to float32 at a time (8 KiB: stays in L1)
constexpr int64_t kEmaGrainBlocks = 16;  // blocks per parallel task

struct Shadow {
  float* data;
  float w;
};

// Lerp of one block of a shadow toward the float32 source block, as ATen's lerp rounds it.
inline void lerp_block(float* s, const float* end, int64_t m, float w) {
  const bool small = std::abs(w) < 0.5f;
  const float c = small ? w : w - 1.0f;
  const Vec vc(c);
  int64_t i = 0;
  for (; i + Vec::size() <= m; i += Vec::size()) {
    const Vec e = Vec::loadu(end + i), a = Vec::loadu(s + i);
    at::vec::fmadd(vc, e - a, small ? a : e).store(s + i);
  }
  for (; i < m; ++i) s[i] = std::fma(c, end[i] - s[i], small ? s[i] : end[i]);
}

template <typename T>
void write_copy(const float* src, void* dst, int64_t offset, int64_t m) {
  cpu::convert_row(src, static_cast<T*>(dst) + offset, m);
}

void ema_update_cpu(at::TensorList shadows, const at::Tensor& source, at::ArrayRef<double> weights,
                    at::TensorList copies, at::IntArrayRef copy_of) {
  const int64_t S = static_cast<int64_t>(shadows.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == S, "ema_update_: one weight per shadow, got ", weights.size(),
              " weights for ", S, " shadows");
  TORCH_CHECK(copies.size() == copy_of.size(), "ema_update_: copy_of must name one shadow per copy, got ",
              copy_of.size(), " for ", copies.size(), " copies");
  check_float_kind(source, "ema_update_: source");
  TORCH_CHECK(source.is_contiguous(), "ema_update_: source must be contiguous");
  const int64_t n = source.numel();
  std::vector<Shadow> sh;
  for (int64_t k = 0; k < S; ++k) {
    const at::Tensor& s = shadows[k];
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == n,
                "ema_update_: shadow ", k, " must be a contiguous float32 tensor of the source's ", n,
                " elements, got ", s.scalar_type(), " ", s.sizes());
    check_device(s, source.device(), "ema_update_: shadow");
    TORCH_CHECK(weights[k] >= 0.0 && weights[k] <= 1.0, "ema_update_: weight ", k, " (1 - decay) must be in [0, 1], got ",
                weights[k]);
    sh.push_back({s.data_ptr<float>(), static_cast<float>(weights[k])});
  }
  // per shadow, the copies it is written into
  std::vector<std::vector<int64_t>> copies_of(S);
  for (size_t j = 0; j < copies.size(); ++j) {
    TORCH_CHECK(copy_of[j] >= 0 && copy_of[j] < S, "ema_update_: copy_of[", j, "] = ", copy_of[j],
                " names no shadow (there are ", S, ")");
    check_float_kind(copies[j], "ema_update_: copy");
    TORCH_CHECK(copies[j].is_contiguous() && copies[j].numel() == n, "ema_update_: copy ", j,
                " must be contiguous with the source's ", n, " elements, got ", copies[j].sizes());
    check_device(copies[j], source.device(), "ema_update_: copy");
    copies_of[copy_of[j]].push_back(static_cast<int64_t>(j));
  }
  if (n == 0 || S == 0) return;
  VQLCMD_DISPATCH_FLOAT(source.scalar_type(), "ema_update_cpu", [&] {
    const scalar_t* src = source.data_ptr<scalar_t>();
    const int64_t blocks = (n + kEmaBlock - 1) / kEmaBlock;
    at::parallel_for(0, blocks, kEmaGrainBlocks, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(kEmaBlock);
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t off = b * kEmaBlock, m = std::min(kEmaBlock, n - off);
        const float* end = cpu::row_as_float(src + off, buf.data(), m);
        for (int64_t k = 0; k < S; ++k) {
          float* s = sh[k].data + off;
          lerp_block(s, end, m, sh[k].w);
          for (const int64_t j : copies_of[k]) {  // while the block is in cache
            void* dst = copies[j].data_ptr();
            switch (copies[j].scalar_type()) {
              case at::kBFloat16: write_copy<at::BFloat16>(s, dst, off, m); break;
              case at::kHalf: write_copy<at::Half>(s, dst, off, m); break;
              default: write_copy<float>(s, dst, off, m); break;
            }
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) { m.impl("ema_update_", &ema_update_cpu); }

}  // namespace vqlcmd
