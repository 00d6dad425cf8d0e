// The schemas of the vqlcmd ops, declared once. Device implementations live
// beside each op (TORCH_LIBRARY_IMPL CPU in *_cpu.cpp, CUDA in *.cu); autograd
// and fake (meta) implementations are registered from Python in
// vqlcmd/ops/_compiled.py (importing vqlcmd._C runs vqlcmd/__init__.py, which
// imports it). set_python_module names that module: torch's error for a missing
// fake implementation then says what to import, and register_fake checks it.
#include <torch/library.h>

TORCH_LIBRARY(vqlcmd, m) {
  m.set_python_module("vqlcmd.ops._compiled");
  // z = alpha E[x'] + sigma eps; eps = noise, or Philox(seed, offset) when noise is None. seed_tensor
  // (one int64 on the op's device), when given, replaces seed: the kernel reads it, so a CUDA graph
  // replays with the seed drawn on the device at each replay rather than one baked in at capture.
  m.def(
      "noise_embeddings(Tensor tokens, Tensor table, Tensor alpha, Tensor sigma, Tensor? noise, "
      "Tensor? drop_mask, int mask_index, int seed, int offset, Tensor? seed_tensor=None) -> Tensor");
  // float32 (num_rows, D) gradient of the table: scatter-add of alpha * grad.
  m.def(
      "noise_embeddings_backward(Tensor grad, Tensor tokens, Tensor? drop_mask, int mask_index, Tensor alpha, "
      "int num_rows, bool deterministic) -> Tensor");
  m.def(
      "ddim_teacher_step(Tensor tokens, Tensor table, Tensor z_t, Tensor alpha_t, Tensor sigma_t, "
      "Tensor alpha_s, Tensor sigma_s) -> Tensor");
  // (kl, d kl / d student) per row; the gradient is empty unless emit_grad.
  m.def("categorical_kl(Tensor teacher, Tensor student, bool emit_grad) -> (Tensor, Tensor)");
  m.def("categorical_kl_backward(Tensor grad_kl, Tensor teacher, Tensor student) -> Tensor");
  // DiT's tanh-approximate GELU (CPU kernel only; see csrc/gelu_tanh/).
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor grad, Tensor x) -> Tensor");
  // The denoiser's AdaLN, (1 + scale) LayerNorm(h) + shift (CPU kernel only; see csrc/ada_layer_norm/):
  // (y, per-row mean, per-row rstd), the last two float32 (B, M) for the backward.
  m.def("ada_layer_norm(Tensor h, Tensor scale, Tensor shift, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "ada_layer_norm_backward(Tensor grad, Tensor h, Tensor scale, Tensor mean, Tensor rstd) "
      "-> (Tensor, Tensor, Tensor)");
  // The EMA update of flat shadows (float32) toward one source, θ̄_k += w_k (θ − θ̄_k) rounded as torch.lerp,
  // and copies[j] = the updated shadow copy_of[j] in the copy's dtype (CPU kernel only; see csrc/ema/).
  m.def("ema_update_(Tensor(a!)[] shadows, Tensor source, float[] weights, Tensor(b!)[] copies, int[] copy_of) -> ()");
  // Bidirectional softmax(q kᵀ/√d) v for short sequences, q, k, v (B, H, M, hd) (CPU kernel only; see
  // csrc/attention/): (out, per-row log-sum-exp float32 (B, H, M)) for the backward. dropout_p > 0 drops
  // attention probabilities by a Philox mask keyed by seed (a one-element int64 tensor).
  m.def("short_attention(Tensor q, Tensor k, Tensor v, float dropout_p=0., Tensor? seed=None) -> (Tensor, Tensor)");
  m.def(
      "short_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float dropout_p=0., Tensor? seed=None) -> (Tensor, Tensor, Tensor)");
}
