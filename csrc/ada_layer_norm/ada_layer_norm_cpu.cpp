// CPU kernels of ada_layer_norm: y = (1 + a) LayerNorm(h) + b in one pass over
// each row, and its backward in one pass over each image (ada_layer_norm.h).
// No CUDA kernel: on GPUs the reference (PyTorch's LayerNorm plus two broadcast
// ops) is memory-bound passes that the launch-heavy small-model step hides; the
// CPU is where they cost, ~6% of the digits model's training step.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../common/cpu_vec.h"
#include "../common/dispatch.h"
#include "ada_layer_norm.h"

namespace vqlcmd {
namespace {

using cpu::Vec;
using cpu::reduce_sum;

constexpr int64_t kRowGrain = 64;  // rows per parallel task (forward)

RowMoments row_moments(const float* x, int64_t w, float eps) {
  Vec vs(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= w; j += Vec::size()) vs = vs + Vec::loadu(x + j);
  float s = reduce_sum(vs);
  for (; j < w; ++j) s += x[j];
  const float mean = s / static_cast<float>(w);
  const Vec vm(mean);
  Vec vq(0.0f);
  j = 0;
  for (; j + Vec::size() <= w; j += Vec::size()) {
    const Vec d = Vec::loadu(x + j) - vm;
    vq = at::vec::fmadd(d, d, vq);
  }
  float q = reduce_sum(vq);
  for (; j < w; ++j) q += (x[j] - mean) * (x[j] - mean);
  return {mean, 1.0f / std::sqrt(q / static_cast<float>(w) + eps)};
}

void row_forward(const float* x, const float* a, const float* b, RowMoments m, float* y, int64_t w) {
  const Vec vm(m.mean), vr(m.rstd);
  int64_t j = 0;
  for (; j + Vec::size() <= w; j += Vec::size()) {
    ada_ln_out(ada_ln_normalized(Vec::loadu(x + j), vm, vr), Vec::loadu(a + j), Vec::loadu(b + j)).store(y + j);
  }
  for (; j < w; ++j) y[j] = ada_ln_out(ada_ln_normalized(x[j], m.mean, m.rstd), a[j], b[j]);
}

// dh of one row into `dh`; the row's dy * n and dy added to da, db. n and dn go
// through the scratch rows so that the second pass does not recompute them.
void row_backward(const float* g, const float* x, const float* a, RowMoments m, float* dh, float* da, float* db,
                  float* n_buf, float* dn_buf, int64_t w) {
  const Vec vm(m.mean), vr(m.rstd), one(1.0f);
  Vec v1(0.0f), v2(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= w; j += Vec::size()) {
    const Vec n = ada_ln_normalized(Vec::loadu(x + j), vm, vr), dy = Vec::loadu(g + j);
    const Vec dn = dy * (one + Vec::loadu(a + j));
    n.store(n_buf + j);
    dn.store(dn_buf + j);
    v1 = v1 + dn;
    v2 = at::vec::fmadd(dn, n, v2);
    (Vec::loadu(da + j) + dy * n).store(da + j);
    (Vec::loadu(db + j) + dy).store(db + j);
  }
  float s1 = reduce_sum(v1), s2 = reduce_sum(v2);
  for (; j < w; ++j) {
    const float n = ada_ln_normalized(x[j], m.mean, m.rstd), dn = g[j] * (1.0f + a[j]);
    n_buf[j] = n;
    dn_buf[j] = dn;
    s1 += dn;
    s2 += dn * n;
    da[j] += g[j] * n;
    db[j] += g[j];
  }
  const float c1 = s1 / static_cast<float>(w), c2 = s2 / static_cast<float>(w);
  const Vec vc1(c1), vc2(c2);
  j = 0;
  for (; j + Vec::size() <= w; j += Vec::size()) {
    ada_ln_dh(Vec::loadu(dn_buf + j), Vec::loadu(n_buf + j), vr, vc1, vc2).store(dh + j);
  }
  for (; j < w; ++j) dh[j] = ada_ln_dh(dn_buf[j], n_buf[j], m.rstd, c1, c2);
}

void check_modulation(const at::Tensor& h, const at::Tensor& v, const char* name) {
  check_float_kind(v, name);
  TORCH_CHECK(v.dim() == 2 && v.size(0) == h.size(0) && v.size(1) == h.size(2), "ada_layer_norm: ", name,
              " must be (B, W) = (", h.size(0), ", ", h.size(2), "), got ", v.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ada_layer_norm_cpu(const at::Tensor& h, const at::Tensor& scale,
                                                                  const at::Tensor& shift, double eps) {
  check_float_kind(h, "ada_layer_norm: h");
  TORCH_CHECK(h.dim() == 3, "ada_layer_norm: h must be (B, M, W), got ", h.sizes());
  check_modulation(h, scale, "scale");
  check_modulation(h, shift, "shift");
  const int64_t B = h.size(0), M = h.size(1), W = h.size(2), rows = B * M;
  const at::Tensor hc = h.contiguous();
  const at::Tensor a = scale.to(at::kFloat).contiguous(), b = shift.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(hc, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty({B, M}, h.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({B, M}, h.options().dtype(at::kFloat));
  if (rows == 0 || W == 0) {
    // rows of no elements: PyTorch's native_layer_norm gives mean 0, rstd NaN (these were never written)
    mean.zero_();
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return {y, mean, rstd};
  }
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* mp = mean.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  VQLCMD_DISPATCH_FLOAT(h.scalar_type(), "ada_layer_norm_cpu", [&] {
    const scalar_t* hp = hc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      std::vector<float> xbuf(W), ybuf(W);
      for (int64_t r = lo; r < hi; ++r) {
        const float* x = cpu::row_as_float(hp + r * W, xbuf.data(), W);
        float* yr = cpu::out_row(yp + r * W, ybuf.data());
        const RowMoments m = row_moments(x, W, static_cast<float>(eps));
        const int64_t img = r / M;
        row_forward(x, ap + img * W, bp + img * W, m, yr, W);
        cpu::store_row(yr, yp + r * W, W);
        mp[r] = m.mean;
        rp[r] = m.rstd;
      }
    });
  });
  return {y, mean, rstd};
}

// One task per image: the image's rows all add into its (da, db), so the split
// needs no atomics and the sums do not depend on the thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ada_layer_norm_backward_cpu(const at::Tensor& grad,
                                                                           const at::Tensor& h,
                                                                           const at::Tensor& scale,
                                                                           const at::Tensor& mean,
                                                                           const at::Tensor& rstd) {
  check_float_kind(h, "ada_layer_norm_backward: h");
  TORCH_CHECK(h.dim() == 3, "ada_layer_norm_backward: h must be (B, M, W), got ", h.sizes());
  TORCH_CHECK(grad.sizes() == h.sizes(), "ada_layer_norm_backward: grad has shape ", grad.sizes(), " but h has ",
              h.sizes());
  check_modulation(h, scale, "scale");
  const int64_t B = h.size(0), M = h.size(1), W = h.size(2);
  for (const at::Tensor* s : {&mean, &rstd}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->dim() == 2 && s->size(0) == B && s->size(1) == M,
                "ada_layer_norm_backward: mean and rstd must be float32 (B, M) = (", B, ", ", M, "), got ",
                s->scalar_type(), " ", s->sizes());
  }
  const at::Tensor hc = h.contiguous(), gc = grad.to(h.scalar_type()).contiguous();
  const at::Tensor a = scale.to(at::kFloat).contiguous();
  const at::Tensor mc = mean.contiguous(), rc = rstd.contiguous();
  at::Tensor dh = at::empty_like(hc, at::MemoryFormat::Contiguous);
  at::Tensor da = at::zeros({B, W}, h.options().dtype(at::kFloat));
  at::Tensor db = at::zeros({B, W}, h.options().dtype(at::kFloat));
  if (B * M > 0 && W > 0) {
    const float* ap = a.data_ptr<float>();
    const float* mp = mc.data_ptr<float>();
    const float* rp = rc.data_ptr<float>();
    float* dap = da.data_ptr<float>();
    float* dbp = db.data_ptr<float>();
    VQLCMD_DISPATCH_FLOAT(h.scalar_type(), "ada_layer_norm_backward_cpu", [&] {
      const scalar_t* hp = hc.data_ptr<scalar_t>();
      const scalar_t* gp = gc.data_ptr<scalar_t>();
      scalar_t* dhp = dh.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
        std::vector<float> xbuf(W), gbuf(W), dbuf(W), nbuf(W), dnbuf(W);
        for (int64_t img = lo; img < hi; ++img) {
          for (int64_t r = img * M; r < (img + 1) * M; ++r) {
            const float* x = cpu::row_as_float(hp + r * W, xbuf.data(), W);
            const float* g = cpu::row_as_float(gp + r * W, gbuf.data(), W);
            float* dr = cpu::out_row(dhp + r * W, dbuf.data());
            row_backward(g, x, ap + img * W, {mp[r], rp[r]}, dr, dap + img * W, dbp + img * W, nbuf.data(),
                         dnbuf.data(), W);
            cpu::store_row(dr, dhp + r * W, W);
          }
        }
      });
    });
  }
  return {dh, da.to(scale.scalar_type()), db.to(scale.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) {
  m.impl("ada_layer_norm", &ada_layer_norm_cpu);
  m.impl("ada_layer_norm_backward", &ada_layer_norm_backward_cpu);
}

}  // namespace vqlcmd
