// CPU kernel of ddim_teacher_step: gather from the EMA table and the DDIM update
// in one pass over z_t, rows in parallel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/cpu_vec.h"
#include "../noise_embeddings/noise_embeddings.h"
#include "ddim_teacher_step.h"
#include "ddim_teacher_step_args.h"

namespace vqlcmd {
namespace {

using cpu::Vec;

template <typename z_t_type, typename table_t>
void ddim_rows(const DdimArgs& a, z_t_type* out) {
  const int64_t* rows = a.rows.data_ptr<int64_t>();
  const table_t* table = a.table.data_ptr<table_t>();
  const z_t_type* z = a.z_t.data_ptr<z_t_type>();
  const float* alpha_t = a.alpha_t.data_ptr<float>();
  const float* alpha_s = a.alpha_s.data_ptr<float>();
  const float* ratio = a.ratio.data_ptr<float>();
  const int64_t D = a.D;
  at::parallel_for(0, a.B * a.M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> ebuf(D), zbuf(D), obuf(D);
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t row = rows[r];
      TORCH_CHECK_INDEX(row_in_range(row, a.V), "ddim_teacher_step: token id ", row,
                        " outside the table's rows [0, ", a.V, ")");
      const float* e = cpu::row_as_float(table + row * D, ebuf.data(), D);
      const float* zt = cpu::row_as_float(z + r * D, zbuf.data(), D);
      const int64_t b = r / a.M;
      const float at_ = alpha_t[b], as_ = alpha_s[b], k = ratio[b];
      float* o = cpu::out_row(out + r * D, obuf.data());
      const Vec vat(at_), vas(as_), vk(k);
      int64_t d = 0;
      for (; d + Vec::size() <= D; d += Vec::size()) {
        const Vec ve = Vec::loadu(e + d);
        (vas * ve + vk * (Vec::loadu(zt + d) - vat * ve)).store(o + d);
      }
      for (; d < D; ++d) o[d] = ddim_step(e[d], zt[d], at_, as_, k);
      cpu::store_row(o, out + r * D, D);
    }
  });
}

at::Tensor ddim_teacher_step_cpu(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& z_t,
                                 const at::Tensor& alpha_t, const at::Tensor& sigma_t, const at::Tensor& alpha_s,
                                 const at::Tensor& sigma_s) {
  const DdimArgs a = ddim_args(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s);
  at::Tensor out = at::empty({a.B, a.M, a.D}, z_t.options());
  if (out.numel() == 0) return out;
  VQLCMD_DISPATCH_FLOAT(z_t.scalar_type(), "ddim_teacher_step_cpu", [&] {
    using z_type = scalar_t;
    VQLCMD_DISPATCH_FLOAT(table.scalar_type(), "ddim_teacher_step_cpu", [&] {
      ddim_rows<z_type, scalar_t>(a, out.data_ptr<z_type>());
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vqlcmd, CPU, m) { m.impl("ddim_teacher_step", &ddim_teacher_step_cpu); }

}  // namespace vqlcmd
