"""The ``compiled`` backend: ``torch.ops.vqlcmd.*`` from the extension ``vqlcmd._C`` (csrc/).

The schemas and the CPU/CUDA kernels are C++ (csrc/registration.cpp and one
folder per op); this module adds what torch wants from Python: fake (meta)
implementations, so ``torch.compile`` traces the ops, and autograd formulas.
The tensor's device picks the CPU or CUDA kernel through the dispatcher.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Optional

import torch

from ._dispatch import register
from .reference import philox_seed

_IMPORT_ERROR: Optional[str] = None
try:
    from vqlcmd import _C
except ImportError as exc:  # not built: only the reference backend serves
    _C = None
    _IMPORT_ERROR = f"the C++/CUDA extension vqlcmd._C is not built ({exc}); run `pip install --no-build-isolation -e .`"

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# categorical_kl: emit d KL/d student in the forward, so the backward is one
# scale (as fused cross-entropy kernels do), or recompute it in the backward from
# the saved logits. Recomputing is the default on both devices, because both
# measured faster: on CPU each fresh (N, K) buffer costs page faults that outweigh
# the saved read (emit 475 ms vs recompute 390 ms fwd+bwd at N=16384, K=1024); on
# an H200, where the one-read kernels run at copy bandwidth, the forward plus the
# backward kernel take 32 + 49 us, while emitting costs 49 us plus an unfused
# per-row scale (55 us) and autograd's zero-filled gradient for the emitted
# output (15 us). Recomputing also holds no extra (N, K) tensor between forward
# and backward. VQLCMD_KL_EMIT_GRAD=1 forces emitting (0 or unset: recompute).
_EMIT_ENV = os.environ.get("VQLCMD_KL_EMIT_GRAD")
EMIT_KL_GRAD: bool = _EMIT_ENV not in (None, "0")


def unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def build_info() -> dict:
    """How the extension was built: CUDA version and architectures, compiler, CPU vectors."""
    return dict(_C.build_info) if _C is not None else {"built": False, "why": _IMPORT_ERROR}


def describe() -> str:
    if _C is None:
        return f"compiled backend: unavailable: {_IMPORT_ERROR}"
    info = build_info()
    cuda = (f"CUDA kernels (CUDA {info['cuda_version']}, arch {info['cuda_arch_list']})" if info["with_cuda"]
            else "no CUDA kernels")
    threads = "OpenMP" if info.get("openmp") else "one thread: built without OpenMP"
    return f"compiled backend: CPU kernels ({info['cpu_vector']}, {threads}) + {cuda}; {info['compiler']}"


def unsupported(*tensors: torch.Tensor) -> Optional[str]:
    for x in tensors:
        if x.is_floating_point() and x.dtype not in KERNEL_DTYPES:
            return f"compiled kernels take float32, bfloat16 or float16, got {x.dtype} (the reference serves it)"
    device = tensors[0].device
    if device.type == "cuda":
        if not build_info().get("with_cuda", False):
            return "vqlcmd._C was built without CUDA kernels (no toolkit or VQLCMD_SKIP_CUDA=1 at build time)"
        return _arch_mismatch(device)
    if device.type != "cpu":
        return f"compiled kernels run on cpu and cuda, got device {device}"
    return None


def _built_archs() -> tuple[tuple[int, int, bool, bool], ...]:
    return _parse_archs(str(build_info().get("cuda_arch_list", "")))


@functools.lru_cache(maxsize=None)  # asked on every dispatch of a CUDA op
def _parse_archs(text: str) -> tuple[tuple[int, int, bool, bool], ...]:
    """(major, minor, with PTX, this exact GPU only) of each architecture in an arch list: torch's form
    ("8.0;9.0+PTX", from setup.py) or CMake's ("80;90a", "90-real", "90-virtual", from CMakeLists.txt; a
    bare number there embeds PTX too). Empty when any item is of neither form (a name such as "Hopper" or
    "native", a suffix such as "10.0f"): the build is then trusted."""
    out = []
    for item in text.replace(",", ";").replace(" ", ";").split(";"):
        name = item.strip().upper()
        if not name:
            continue
        # an "a" architecture's code (and PTX) runs on exactly that architecture: not on later minors or majors
        # torch's form has PTX only with "+PTX"; CMake's has it unless "-real"
        form = re.fullmatch(r"(\d+)\.(\d)(A?)(\+PTX)?", name) or re.fullmatch(r"(\d+)(\d)(A?)(-REAL|-VIRTUAL)?", name)
        if form is None:
            return ()
        major, minor, arch_a, suffix = form.groups()
        ptx = suffix == "+PTX" if "." in name else suffix != "-REAL"
        out.append((int(major), int(minor), ptx and not arch_a, bool(arch_a)))
    return tuple(out)


def _arch_mismatch(device: torch.device) -> Optional[str]:
    """Why the CUDA kernels cannot run on this GPU (None: they can). sm_XY code runs on X.Y and later minors
    of major X (sm_XYa on X.Y only); PTX also compiles for later majors. An unreadable list is trusted."""
    built = _built_archs()
    if not built:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if any(m == major and (n == minor if exact else n <= minor) or ptx and (m, n) <= (major, minor)
           for m, n, ptx, exact in built):
        return None
    return (f"vqlcmd._C's CUDA kernels were built for sm {build_info().get('cuda_arch_list')}, not this GPU's "
            f"{major}.{minor}: rebuild with TORCH_CUDA_ARCH_LIST=\"{major}.{minor}\" (the reference serves it meanwhile)")


def _priority(device: torch.device) -> int:
    return 10 if device.type == "cpu" else 5


# ---- noise_embeddings ------------------------------------------------------------------------

def noise_draw(tokens, table, *, generator=None) -> dict:
    """What ``noise_embeddings`` draws from ``generator``: the Philox key, as ``noise_key``."""
    return {"noise_key": philox_seed(generator, table.device)}


def noise_embeddings(tokens, table, alpha, sigma, *, noise=None, drop_mask=None, mask_index=None, generator=None,
                     noise_key=None):
    seed_tensor = noise_key
    if noise is None and seed_tensor is None:
        seed_tensor = philox_seed(generator, table.device)
    elif noise is not None and noise.dtype not in KERNEL_DTYPES:
        noise = noise.float()
    return torch.ops.vqlcmd.noise_embeddings(tokens, table, alpha, sigma, noise, drop_mask,
                                             -1 if mask_index is None else int(mask_index), 0, 0, seed_tensor)


def _noise_setup_context(ctx, inputs, output):
    tokens, table, alpha, sigma, noise, drop_mask, mask_index, seed, offset, seed_tensor = inputs
    ctx.save_for_backward(tokens, table, alpha, sigma, noise, drop_mask, seed_tensor)
    ctx.mask_index, ctx.seed, ctx.offset = mask_index, seed, offset


def _noise_backward(ctx, grad):
    tokens, table, alpha, sigma, noise, drop_mask, seed_tensor = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad_table = grad_alpha = grad_sigma = grad_noise = None
    if need[1]:  # d z / d table: scatter-add of alpha * grad (the case training needs)
        grad_table = torch.ops.vqlcmd.noise_embeddings_backward(
            grad, tokens, drop_mask, ctx.mask_index, alpha, table.shape[0],
            torch.are_deterministic_algorithms_enabled()).to(table.dtype)
    if need[2]:  # rare: plain PyTorch, alpha is not learned in VQ-LCMD
        ids = tokens.long() if drop_mask is None else torch.where(drop_mask, ctx.mask_index, tokens.long())
        grad_alpha = (grad.float() * table[ids].float()).sum((1, 2)).to(alpha.dtype)
    if need[3]:
        eps = noise
        if eps is None:  # the counter-based stream regenerates the drawn noise
            zeros, ones = torch.zeros_like(alpha), torch.ones_like(sigma)
            # with a float32 table: the op returns the table's dtype, and the forward added float32 noise
            eps = torch.ops.vqlcmd.noise_embeddings(tokens, table.float(), zeros, ones, None, drop_mask,
                                                    ctx.mask_index, ctx.seed, ctx.offset, seed_tensor)
        grad_sigma = (grad.float() * eps.float()).sum((1, 2)).to(sigma.dtype)
    if noise is not None and need[4]:
        grad_noise = (grad.float() * sigma.float()[:, None, None]).to(noise.dtype)
    return None, grad_table, grad_alpha, grad_sigma, grad_noise, None, None, None, None, None


# ---- ddim_teacher_step -----------------------------------------------------------------------

def ddim_teacher_step(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s):
    if table.dtype not in KERNEL_DTYPES:  # the dispatcher saw z_t's dtype only
        table = table.float()
    with torch.no_grad():  # the teacher is a fixed target (docs/method.md §7)
        return torch.ops.vqlcmd.ddim_teacher_step(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s)


# ---- categorical_kl --------------------------------------------------------------------------

def categorical_kl(teacher_logits, student_logits):
    emit = EMIT_KL_GRAD and student_logits.requires_grad and torch.is_grad_enabled()
    kl, _ = torch.ops.vqlcmd.categorical_kl(teacher_logits.detach(), student_logits, emit)
    return kl


def _kl_setup_context(ctx, inputs, output):
    teacher, student, emit_grad = inputs
    kl, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.emit_grad = emit_grad
    ctx.save_for_backward(grad if emit_grad else None, None if emit_grad else teacher,
                          None if emit_grad else student)


def _kl_backward(ctx, grad_kl, _grad_of_grad):
    grad, teacher, student = ctx.saved_tensors
    if ctx.emit_grad:  # forward wrote q - p already: the chain rule is a per-row scale
        if torch.is_grad_enabled():
            # create_graph=True: the emitted gradient is a constant to autograd, so a second derivative
            # would drop d2KL/dstudent2 silently. The student is not saved in this mode (that is its
            # point), so no node could raise later, when it is differentiated: refuse here.
            raise RuntimeError("vqlcmd::categorical_kl: the compiled backend has no second derivative (a "
                               "gradient of its gradient, create_graph=True; with VQLCMD_KL_EMIT_GRAD=1 any "
                               "create_graph=True backward); use backend='reference' for double backward")
        grad_student = (grad.float() * grad_kl.float()[..., None]).to(grad.dtype)
    else:
        grad_student = torch.ops.vqlcmd.categorical_kl_backward(grad_kl, teacher, student)
    return None, grad_student, None


# ---- gelu_tanh -------------------------------------------------------------------------------

def gelu_tanh(x):
    return torch.ops.vqlcmd.gelu_tanh(x)


def _gelu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.vqlcmd.gelu_tanh_backward(grad, x)


def _gelu_unsupported(x: torch.Tensor) -> Optional[str]:
    if x.device.type != "cpu":
        return ("gelu_tanh has a CPU kernel only: on GPUs PyTorch's GELU is one memory-bound pass already "
                "(the reference serves it)")
    return unsupported(x)


# ---- ada_layer_norm --------------------------------------------------------------------------

def ada_layer_norm(h, scale, shift, eps):
    return torch.ops.vqlcmd.ada_layer_norm(h, scale, shift, eps)[0]


def _ada_setup_context(ctx, inputs, output):
    h, scale, shift, _eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(h, scale, mean, rstd)
    ctx.shift_dtype = shift.dtype


def _ada_backward(ctx, grad, _grad_mean, _grad_rstd):
    h, scale, mean, rstd = ctx.saved_tensors
    dh, dscale, dshift = torch.ops.vqlcmd.ada_layer_norm_backward(grad, h, scale, mean, rstd)
    return dh, dscale, dshift.to(ctx.shift_dtype), None


def _ada_unsupported(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> Optional[str]:
    if h.device.type != "cpu":
        return ("ada_layer_norm has a CPU kernel only: on GPUs PyTorch's LayerNorm and the two broadcast ops "
                "are memory-bound passes already (the reference serves it)")
    return unsupported(h, scale, shift)


# ---- short_attention -------------------------------------------------------------------------

SHORT_ATTENTION_MAX_LEN = 1024  # csrc/attention: kMaxLen


def short_attention(q, k, v, dropout_p=0.0, seed=None):
    return torch.ops.vqlcmd.short_attention(q, k, v, dropout_p, seed)[0]


def _attn_setup_context(ctx, inputs, output):
    q, k, v, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.dropout_p = dropout_p


def _attn_backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    return (*torch.ops.vqlcmd.short_attention_backward(grad, q, k, v, out, lse, ctx.dropout_p, seed), None, None)


def _attn_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    if q.device.type != "cpu":
        return "short_attention has a CPU kernel only (GPUs have FlashAttention and SDPA; the reference serves it)"
    if q.shape[2] > SHORT_ATTENTION_MAX_LEN:
        return f"short_attention's kernel takes up to {SHORT_ATTENTION_MAX_LEN} tokens, got {q.shape[2]}"
    return unsupported(q, k, v)


def _blhd_empty(x: torch.Tensor) -> torch.Tensor:
    B, H, M, hd = x.shape
    return x.new_empty((B, M, H, hd)).permute(0, 2, 1, 3)


# ---- ema_update_ -----------------------------------------------------------------------------

def ema_update_(shadows, source, weights, copies, copy_of):
    torch.ops.vqlcmd.ema_update_(shadows, source, weights, copies, copy_of)


def _ema_unsupported(source: torch.Tensor) -> Optional[str]:
    if source.device.type != "cpu":
        return ("ema_update_ has a CPU kernel only: on GPUs the reference's cast, lerp_ per shadow and copies are "
                "one memory-bound kernel each (the reference serves it)")
    return unsupported(source)


# ---- torch.library: fake implementations and autograd ------------------------------------------

def _no_context(ctx, inputs, output) -> None:
    pass


def _no_double_backward(name: str):
    op = name.removesuffix("_backward")

    def backward(ctx, *grads):
        raise RuntimeError(f"vqlcmd::{op}: the compiled backend has no second derivative (a gradient of its "
                           "gradient, create_graph=True); use backend='reference' for double backward")

    return backward


def _register_library() -> None:
    lib = "vqlcmd::"

    @torch.library.register_fake(lib + "noise_embeddings")
    def _(tokens, table, alpha, sigma, noise, drop_mask, mask_index, seed, offset, seed_tensor=None):
        return table.new_empty((tokens.shape[0], tokens.shape[1], table.shape[1]))

    @torch.library.register_fake(lib + "noise_embeddings_backward")
    def _(grad, tokens, drop_mask, mask_index, alpha, num_rows, deterministic):
        return grad.new_empty((num_rows, grad.shape[2]), dtype=torch.float32)

    @torch.library.register_fake(lib + "ddim_teacher_step")
    def _(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s):
        return z_t.new_empty((tokens.shape[0], tokens.shape[1], table.shape[1]))

    @torch.library.register_fake(lib + "categorical_kl")
    def _(teacher, student, emit_grad):
        kl = teacher.new_empty(teacher.shape[:-1], dtype=torch.float32)
        return kl, student.new_empty(student.shape if emit_grad else (0,))

    @torch.library.register_fake(lib + "categorical_kl_backward")
    def _(grad_kl, teacher, student):
        return student.new_empty(student.shape)

    @torch.library.register_fake(lib + "gelu_tanh")
    def _(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "gelu_tanh_backward")
    def _(grad, x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "ada_layer_norm")
    def _(h, scale, shift, eps):
        stats = h.new_empty(h.shape[:2], dtype=torch.float32)
        return torch.empty_like(h, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)

    @torch.library.register_fake(lib + "ada_layer_norm_backward")
    def _(grad, h, scale, mean, rstd):
        return (torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(scale),
                torch.empty_like(scale))

    @torch.library.register_fake(lib + "ema_update_")
    def _(shadows, source, weights, copies, copy_of):
        return None

    @torch.library.register_fake(lib + "short_attention")
    def _(q, k, v, dropout_p=0.0, seed=None):
        return _blhd_empty(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.register_fake(lib + "short_attention_backward")
    def _(grad, q, k, v, out, lse, dropout_p=0.0, seed=None):
        return _blhd_empty(q), _blhd_empty(q), _blhd_empty(q)

    # The backward ops have no derivative of their own. Unregistered, autograd took them as constants under
    # create_graph=True and a second derivative came out silently wrong (torch only warned); now using one
    # raises, naming the op and the way out.
    for name in (op for op in OPS if op.endswith("_backward")):
        torch.library.register_autograd(lib + name, _no_double_backward(name), setup_context=_no_context)
    torch.library.register_autograd(lib + "short_attention", _attn_backward, setup_context=_attn_setup_context)
    torch.library.register_autograd(lib + "ada_layer_norm", _ada_backward, setup_context=_ada_setup_context)
    torch.library.register_autograd(lib + "gelu_tanh", _gelu_backward, setup_context=_gelu_setup_context)
    torch.library.register_autograd(lib + "noise_embeddings", _noise_backward, setup_context=_noise_setup_context)
    torch.library.register_autograd(lib + "categorical_kl", _kl_backward, setup_context=_kl_setup_context)


OPS = ("noise_embeddings", "noise_embeddings_backward", "ddim_teacher_step", "categorical_kl",
       "categorical_kl_backward", "gelu_tanh", "gelu_tanh_backward", "ada_layer_norm", "ada_layer_norm_backward",
       "short_attention", "short_attention_backward", "ema_update_")


def _missing_ops() -> list[str]:
    """The ops this Python code expects that the loaded vqlcmd._C does not define."""
    def defined(name: str) -> bool:
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(f"vqlcmd::{name}", "CPU")
        except RuntimeError:  # "operator vqlcmd::... does not exist"
            return False

    return [name for name in OPS if not defined(name)]


_MISSING = _missing_ops() if _C is not None else []
if _MISSING:
    # a _C built from an older checkout (a `git pull` that added an op, without a rebuild): registering
    # the missing ops' fake impls raised in `import vqlcmd`; the reference backend serves instead
    _IMPORT_ERROR = (f"vqlcmd._C is older than this code: it lacks {', '.join(_MISSING)}; rebuild it with "
                     "`pip install --no-build-isolation -e .`")
    _C = None
if _C is not None:
    _register_library()

# the token-id kernels raise IndexError on an id outside the table as they read it (TORCH_CHECK_INDEX)
for _op, _fn, _ids in (("noise_embeddings", noise_embeddings, True), ("noise_draw", noise_draw, False),
                       ("ddim_teacher_step", ddim_teacher_step, True), ("categorical_kl", categorical_kl, False)):
    register(_op, "compiled", _fn, unavailable=unavailable, unsupported=unsupported, priority=_priority,
             checks_ids=_ids)


def _elementwise_priority(device: torch.device) -> int:
    """Inside torch.compile on the CPU, below the reference: inductor fuses the reference's norm and GELU into
    its own kernels, where these C++ kernels are opaque calls with their own argument copies around them. At
    imagenet-246m's structure a compiled guided sampling step dispatched 175 ops with the reference here
    against about 250 with the kernels (eager: about 570), benchmarks/sampling_overhead.py."""
    if device.type == "cpu" and torch.compiler.is_compiling():
        return -5
    return _priority(device)


register("gelu_tanh", "compiled", gelu_tanh, unavailable=unavailable, unsupported=_gelu_unsupported,
         priority=_elementwise_priority)
register("ada_layer_norm", "compiled", ada_layer_norm, unavailable=unavailable, unsupported=_ada_unsupported,
         priority=_elementwise_priority)
register("ema_update_", "compiled", ema_update_, unavailable=unavailable, unsupported=_ema_unsupported,
         priority=_priority)
register("short_attention", "compiled", short_attention, unavailable=unavailable, unsupported=_attn_unsupported,
         priority=_priority)
