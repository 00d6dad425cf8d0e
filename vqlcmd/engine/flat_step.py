"""The flat step (``train.step``, docs/fast_training.md): a training step's gradients, clipping and AdamW as a few
operations over DeepSpeed's own flat buffers, outside its engine's per-gradient bookkeeping.

DeepSpeed's ZeRO 1/2 optimizer already keeps the trained weights as views of one flat 16-bit (or fp32)
buffer per parameter group and steps AdamW on one flat fp32 partition of it. Around that, its engine spends
thousands of small ops per step on the gradients: a hook per parameter copying each into a bucket and again
into the partition, a cast and a norm per gradient (``benchmarks/host_overhead.py``). The flat step keeps
DeepSpeed's buffers, optimizer, scheduler and checkpoint format, and does the rest itself:

1. the loss is a function of one leaf tensor aliasing the flat weights: each parameter is a view of it inside
   the (compiled) loss (``torch.func.functional_call``), so the backward yields one flat gradient, and none
   of DeepSpeed's hooks (on the parameters) fire;
2. that gradient is summed over micro-steps into one fp32 buffer, reduce-scattered over the ranks (each
   receives the mean of its own partition, as under ZeRO 2), and
   this rank's partition is clipped by the global norm on the device (one norm, no read);
3. DeepSpeed's inner optimizer steps its fp32 partition, which is copied into the 16-bit partition and
   all-gathered, as DeepSpeed's ``step`` does; the engine's counters and rate schedule move as in
   ``engine.step`` (``_take_model_step``).

So a checkpoint is DeepSpeed's, written by its ``save_checkpoint`` from the same tensors, and a run may
resume it under either step. Only ZeRO 1/2's ``DeepSpeedZeroOptimizer`` without offload, fp16 loss scaling or
the per-tensor overflow check is served (:func:`flat_step_refusal` says why not otherwise).
"""
from __future__ import annotations

from typing import Optional

import itertools

import torch
import torch.distributed as dist

from ..ema import update_emas_flat


class _HooklessForward(torch.nn.Module):
    """The loss module's forward without its hooks, and (``teacher``) the teacher's forward module beside it,
    so that one ``functional_call`` gives both their weights."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = module
        self.teacher: Optional[torch.nn.Module] = None

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)


def _guards_kept(entries) -> list:
    """Which of Dynamo's guards on the compiled loss stay checked before every call: those on its inputs (the
    leaves, the batch, the draws), on global state (grad mode, autocast, the ops' backends), the modules'
    train/eval flags and the step's serial number. Dropped: the ~12,000 on what the loss reads through the
    FlatStep (its fixed layout of 300 pieces, the module tree, the parameters that ``functional_call`` swaps
    out, the config), which a run never changes while it holds the step: checking them took ~2 ms of host
    time a step (``benchmarks/host_overhead.py``). Dynamo's cache is the code's, shared by every FlatStep in
    the process, so the serial (an int read in the loss, specialised as the compile is static) is what keeps
    two steps' graphs apart once the rest is not guarded."""
    return [not e.name.startswith("self.") or e.name == "self.serial" or e.name.endswith(".training")
            for e in entries]


def flat_step_refusal(engine) -> Optional[str]:
    """Why the flat step cannot drive this engine (None: it can)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        return (f"DeepSpeed steps a {type(opt).__name__} here (the flat step drives ZeRO 1/2's "
                "DeepSpeedZeroOptimizer: zero_optimization.stage 1 or 2, not stage 1 in bf16 with "
                "data_types.grad_accum_dtype fp32)")
    if getattr(opt, "cpu_offload", False):
        return "zero_optimization.offload_optimizer is set"
    if engine.fp16_enabled():
        return "fp16 (dynamic loss scaling) is on"
    if getattr(opt, "check_grad_overflow", False):
        return "bf16.check_grad_overflow is true (DeepSpeed's skip of non-finite steps)"
    if getattr(opt, "round_robin_gradients", False) or opt.has_moe_layers:
        return "zero_optimization.round_robin_gradients or MoE layers are set"
    return None


_SERIALS = itertools.count()


# torch 2.14 names them *_single and deprecates the *_tensor names older releases have
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_CHUNK = 1 << 24  # elements: an eager fp64 copy of 128 MB at most


def _square_sum(parts: list) -> torch.Tensor:
    """The sum of the squares of the tensors' elements, accumulated in fp64, as fp32. Compiled, one pass; eager,
    in chunks, so that the fp64 copy stays bounded (a whole partition of imagenet-246m would be 2 GB)."""
    compiling = torch.compiler.is_compiling()
    total = None
    for part in parts:
        for chunk in (part,) if compiling else part.split(_CHUNK):
            wide = chunk.double()
            square = wide.square().sum() if compiling else torch.dot(wide, wide)
            total = square if total is None else total + square
    return total.float()


class FlatStep:
    """Gradients and update of one run on ``engine``'s flat buffers, with the engine's module (the loss) as the
    forward: ``module(tokens, labels, draws=...)`` (or ``generator=``, for a loss that draws inside)."""

    def __init__(self, engine, *, compile_loss: bool, cuda_graphs: bool = False, backend: str = "auto"):
        reason = flat_step_refusal(engine)
        if reason:
            raise ValueError(f"the flat step cannot drive this run: {reason}")
        self.engine, self.opt, self.module = engine, engine.optimizer, engine.module
        self.backend = backend  # train.backend, for the EMA update (the loss's ops take it from the loss module)
        self.serial = next(_SERIALS)
        # the module's forward without its call hooks: DeepSpeed's (timers, micro-step bookkeeping) read engine
        # counters that change every step, which Dynamo would guard on and recompile for
        self._forward = _HooklessForward(self.module)
        self.rank, self.world = self._rank_world()
        names = {id(p): "inner." + n for n, p in self.module.named_parameters()}
        # per parameter group: (leaf aliasing the flat weights, the split sizes that tile it, [(name, piece
        # index, shape, offset)]). Split, not sliced: split's backward is one concatenation of the pieces' gradients,
        # where each slice's is a scatter into a zero buffer the flat buffer's size (300 of them: ~0.4 s a step
        # of imagenet-246m's structure at width 64 on a CPU)
        self.groups = []
        for flat, params in zip(self.opt.bit16_groups_flat, self.opt.bit16_groups):
            leaf = flat.detach().requires_grad_(True)  # the same storage: DeepSpeed's writes are seen
            sizes, pieces, end = [], [], 0
            for p in sorted(params, key=lambda q: q.data_ptr()):
                offset = (p.data_ptr() - flat.data_ptr()) // flat.element_size()
                if (p.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or not p.is_contiguous()
                        or offset < end):
                    raise ValueError(f"parameter {names[id(p)]} is not a view of DeepSpeed's flat buffer")
                if offset > end:  # alignment padding between two parameters
                    sizes.append(offset - end)
                pieces.append((names[id(p)], len(sizes), p.shape, offset))
                sizes.append(p.numel())
                end = offset + p.numel()
            if flat.numel() > end:
                sizes.append(flat.numel() - end)
            self.groups.append((leaf, sizes, pieces))
        self.leaves = [leaf for leaf, _, _ in self.groups]
        # fp32 sums of the micro-steps' gradients, the flat buffers' layout (padding included)
        self.grads = [torch.zeros(leaf.numel(), dtype=torch.float32, device=leaf.device) for leaf in self.leaves]
        # this rank's partition of each (its padding's gradients are zeros): DeepSpeed pads the flat buffer to
        # equal partitions, each rank's the slice at rank x size, which the reductions rely on
        self.parts = []
        for i, acc in enumerate(self.grads):
            size = int(self.opt.partition_size[i])
            if acc.numel() != size * self.world:
                raise ValueError(f"DeepSpeed's flat buffer {i} ({acc.numel()} elements) is not {self.world} "
                                 f"partitions of {size}")
            self.parts.append(acc[self.rank * size:(self.rank + 1) * size])
        # the global norm's square as one fp64 reduction over each partition: compiled (when the loss is) into
        # one pass, eager a cast and a dot per chunk. DeepSpeed sums the squares of one fp64 norm per parameter:
        # the same fp64 number to ~1e-15, so the fp32 norm it is rounded to, the clipping factor and AdamW after
        # it are DeepSpeed's bit for bit (save a ~1e-8 chance of the rounding falling the other way). A norm in
        # fp32 would not do: AdamW scales the rounding noise of the qkv bias's zero k-part gradient up to a
        # fraction of the rate, so any other rounding of the clipping factor moves those weights by ~1e-4.
        self._square_sum = torch.compile(_square_sum, dynamic=False) if compile_loss else _square_sum
        self.norm: Optional[torch.Tensor] = None
        loss = self._loss_of_leaves
        if compile_loss:
            # one graph per micro-step shape: the draws are inputs, not generator calls; "reduce-overhead"
            # captures it in CUDA graphs (static shapes: dynamic=False)
            loss = torch.compile(loss, dynamic=False, mode="reduce-overhead" if cuda_graphs else None,
                                 options={"guard_filter_fn": _guards_kept})
        self.loss = loss

    def flatten_emas(self, emas: list, prefix: str = "inner.net.") -> None:
        """Lay the EMAs of the module's ``net`` out as its flat weights (one group), so that ``update_emas``
        is one pass over the flat weights (``vqlcmd.ops.ema_update_``), not a lerp per parameter."""
        (leaf, _, pieces), = self.groups  # (several groups would need a buffer per group)
        layout = [(name[len(prefix):], offset) for name, _, _, offset in pieces]
        for ema in emas:
            ema.flatten(layout, leaf.numel())
        self.emas = emas
        teacher = getattr(self.module, "teacher", None)
        if teacher in emas and teacher.flat is not None:
            self._forward.teacher = teacher.compute
            self.leaves = self.leaves + [teacher.compute_flat if teacher.compute_flat is not None else teacher.flat]

    def update_emas(self) -> None:
        update_emas_flat(self.emas, self.groups[0][0].detach(), self.module.net, backend=self.backend)

    def _rank_world(self):
        group = self.opt.real_dp_process_group[0]
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(group=group), dist.get_world_size(group=group)

    def _loss_of_leaves(self, leaves, tokens, labels, kwargs):
        if self.serial < 0:  # never: the read is the guard that ties a compiled graph to this step (_guards_kept)
            raise AssertionError("a FlatStep's serial is never negative")
        params = {}
        for leaf, (_, sizes, pieces) in zip(leaves, self.groups):
            chunks = leaf.split(sizes)
            for name, index, shape, _ in pieces:
                params[name] = chunks[index].view(shape)
        if len(leaves) > len(self.groups):  # the teacher's flat weights: one graph input, not one per weight
            (_, sizes, pieces), = self.groups
            chunks = leaves[-1].split(sizes)
            for name, index, shape, _ in pieces:
                params["teacher." + name[len("inner.net."):]] = chunks[index].view(shape)
        return torch.func.functional_call(self._forward, params, (tokens, labels), kwargs, strict=False)

    def micro_step(self, tokens, labels, kwargs: dict, micro: int, gas: int) -> dict:
        """Forward and backward of one micro-batch (``kwargs``: the forward's ``draws`` or ``generator``); its
        gradient (of loss / gas, as DeepSpeed scales it) added to the step's sums. Returns the loss terms
        (device tensors)."""
        out = self.forward(tokens, labels, kwargs)
        self.backward(out["loss"], micro, gas)
        return out

    def forward(self, tokens, labels, kwargs: dict) -> dict:
        return self.loss(self.leaves, tokens, labels, kwargs)

    def backward(self, loss: torch.Tensor, micro: int, gas: int) -> None:
        grads = torch.autograd.grad(loss / gas if gas > 1 else loss, self.leaves[:len(self.grads)])
        for acc, grad in zip(self.grads, grads):
            if micro == 0:
                acc.copy_(grad)
            else:
                acc.add_(grad)

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Average over ranks, clip by the global norm, step AdamW, gather the weights; the engine's counters.
        Returns the gradient norm before clipping (a device tensor), as DeepSpeed's ``_global_grad_norm``."""
        opt, engine, parts = self.opt, self.engine, self.parts
        if self.world > 1:  # ZeRO 2's reduction: each rank receives the sum of its own partition only
            for i, (acc, part) in enumerate(zip(self.grads, parts)):
                _reduce_scatter(part, acc, group=opt.real_dp_process_group[i])  # in place: part is acc's slice
                part.div_(self.world)
        # DeepSpeed's scaled_global_norm (get_grad_norm_direct, combine_grad_norm_groups), to the fp32 bit
        square = self._square_sum(parts)
        if self.world > 1:
            dist.all_reduce(square, group=opt.dp_process_group)
        norm = square.pow(1.0 / 2)
        norm = torch.linalg.vector_norm(torch.stack([torch.where(torch.isfinite(norm), norm, float("inf"))]))
        if opt.clip_grad > 0:  # DeepSpeed's unscale_and_clip_grads, the loss scale being 1
            scale = 1.0 / torch.clamp((norm + 1e-6) / opt.clip_grad, min=1.0)
            torch._foreach_mul_(parts, scale)
        for i, part in enumerate(parts):
            master = opt.single_partition_of_fp32_groups[i]
            master.grad = part
            opt._optimizer_step(i)  # DeepSpeed's inner optimizer on group i, as its own step calls it
            master.grad = None
            opt.parallel_partitioned_bit16_groups[i][self.rank].copy_(master)
        if self.world > 1:  # in place, as DeepSpeed's own: each rank's partition is its slice of the flat buffer
            for i, partitions in enumerate(opt.parallel_partitioned_bit16_groups):
                _all_gather(opt.bit16_groups_flat[i], partitions[self.rank], group=opt.real_dp_process_group[i])
        self.norm = norm
        opt._global_grad_norm = norm
        self._count_step(engine)
        return norm

    @staticmethod
    def _count_step(engine) -> None:
        """What ``engine.step`` does after DeepSpeed's optimizer step, for a step it applied."""
        engine._global_grad_norm = engine.optimizer._global_grad_norm
        engine._step_applied = True
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        engine.losses = None
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        engine.micro_steps += engine.gradient_accumulation_steps()

