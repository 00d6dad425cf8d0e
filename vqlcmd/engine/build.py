"""What a run is built from, in the order the trainer builds it: the data, the network and its EMAs, and the
DeepSpeed engine around the method's loss."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..ema import EMA
from ..methods import get_method
from ..model import preset_config
from ..model.attention import resolved_backend, sdpa_kernel_for
from ..network import VQLCMDNetwork
from ..schedule import ShiftedCosineSchedule
from .config import ConfigError, VQLCMDConfig, repo_path
from .data import open_data
from .distributed import agree_on_setup, data_fingerprint, exchanged
from .flat_step import FlatStep, flat_step_refusal
from .host_memory import release_freed_memory
from .optim import build_optimizer, build_scheduler


@dataclass
class Data:
    source: object  # vqlcmd.engine.data.DataSource: dataset, header, loader(...)
    header: dict  # the shards' (or the image tree's tokenizer's) header
    tokenizer_dir: Optional[str]
    den_cfg: object  # the preset's DenoiserConfig, checked against the data


def build_data(cfg: VQLCMDConfig, rank: int, local_rank: int, device, log, progress: bool) -> Data:
    """Each rank opens its own shards (or image tree); one exchange then stops every rank when one failed
    (the others would wait for it in DeepSpeed's set-up) and refuses ranks that opened different data."""
    error = fingerprint = data = None
    try:
        source = open_data(cfg.data, rank, local_rank=local_rank, device=device, log=log, progress=progress)
        den_cfg = _check_against_data(cfg, preset_config(cfg.model.preset, **cfg.model.overrides), source.header,
                                      source.where)
        data = Data(source, source.header, source.tokenizer_dir, den_cfg)
        fingerprint = data_fingerprint(source.header)
    except Exception as exc:
        if exchanged(exc):  # rank 0's digits preparation failed: every rank knows already
            raise
        error = exc
    agree_on_setup(error, fingerprint)
    if data.tokenizer_dir is None and cfg.train.sample_every:
        log("no data.tokenizer: the sample grids (train.sample_every) are off, since tokens cannot be "
            "decoded; the exported pipeline samples tokens only (output_type='tokens')")
    return data


def _check_against_data(cfg: VQLCMDConfig, den_cfg, header: dict, where: str):
    """``where``: the data as errors name it ("the shards in X", "the images under X (...)")."""
    K, grid = int(header["codebook_size"]), header["grid"]
    M = int(grid[0]) * int(grid[1])
    C = int(header.get("num_classes") or 0)
    over = cfg.model.overrides
    for key, value in (("codebook_size", K), ("seq_len", M)):
        if key in over and over[key] != value:
            raise ConfigError(f"vqlcmd.model.overrides.{key}={over[key]} but {where} hold "
                              f"{key}={value} (tokenizer {header.get('tokenizer_id')})")
    if den_cfg.codebook_size != K or den_cfg.seq_len != M:
        raise ConfigError(
            f"preset {cfg.model.preset!r} expects codebook_size={den_cfg.codebook_size} and "
            f"{den_cfg.seq_len} tokens per image, but {where} hold codebook_size={K} and "
            f"{M} tokens (tokenizer {header.get('tokenizer_id')}); use a matching preset or shards")
    if den_cfg.num_classes not in (0, C):
        raise ConfigError(f"preset {cfg.model.preset!r} has {den_cfg.num_classes} classes but {where} "
                          f"have {C}; set vqlcmd.model.overrides.num_classes")
    if cfg.data.tokenizer and cfg.data.source == "shards":  # (images: the header is the tokenizer's)
        from ..tokenizer import load_tokenizer

        tok = load_tokenizer(repo_path(cfg.data.tokenizer))
        if tok.codebook_size != K:  # the likelier slip than a retrained tokenizer: name the sizes
            raise ConfigError(f"vqlcmd.data.tokenizer {cfg.data.tokenizer} has codebook_size "
                              f"{tok.codebook_size} but {where} hold codebook_size={K} (made by tokenizer "
                              f"{header.get('tokenizer_id')}); give the tokenizer that wrote them")
        if tok.identifier != header.get("tokenizer_id"):
            raise ConfigError(f"vqlcmd.data.tokenizer {cfg.data.tokenizer} has identifier {tok.identifier} "
                              f"but {where} were made by {header.get('tokenizer_id')}")
    return den_cfg


class LossModule(nn.Module):
    """What DeepSpeed wraps: the trained network plus a *reference* to the EMA teacher.

    The teacher is kept out of the module tree (``object.__setattr__``) so that DeepSpeed neither
    optimises nor partitions it. The loss is the method's (``vqlcmd.methods``)."""

    def __init__(self, net: VQLCMDNetwork, teacher: EMA, schedule, cfg: VQLCMDConfig):
        super().__init__()
        self.net = net
        object.__setattr__(self, "teacher", teacher)
        self.schedule, self.cfg, self.backend = schedule, cfg, cfg.train.backend
        self.method = get_method(cfg.method)

    def draw(self, tokens, labels, generator) -> Optional[dict]:
        """The loss's random numbers drawn now (None: the method's loss draws them itself)."""
        if self.method.draw is None:
            return None
        return self.method.draw(self.net, tokens, labels, self.cfg, generator=generator, backend=self.backend)

    def forward(self, tokens, labels, generator=None, draws=None):
        if draws is not None:
            return self.method.losses_drawn(self.net, self.teacher.compute, self.schedule, tokens, labels, self.cfg,
                                            draws, backend=self.backend)
        return self.method.losses(self.net, self.teacher.compute, self.schedule, tokens, labels, self.cfg,
                                  generator=generator, backend=self.backend)


@dataclass
class Model:
    net: VQLCMDNetwork
    teacher: EMA  # η = ema.teacher: the consistency-matching target's weights
    sampling_ema: EMA  # η = ema.sampling: the exported pipeline's weights
    schedule: ShiftedCosineSchedule
    module: LossModule


def check_op_backend(cfg: VQLCMDConfig) -> None:
    """Refuse a ``train.backend`` that one of the method's ops lacks (or that is not built here) before anything
    is built, where the first step would stop on it after the set-up: ``auto`` chooses per op."""
    from .. import ops

    backend = cfg.train.backend
    if backend == "auto":
        return
    for op in get_method(cfg.method).ops:
        reason = ops.why_not(op, backend)  # no inputs: whether the backend exists and is built, for any input
        if reason is not None:
            raise ConfigError(f"vqlcmd.train.backend {backend!r} cannot run method {cfg.method!r}: its loss calls "
                              f"{op}, and {reason}; 'auto' picks the best backend per op")


def build_model_and_emas(cfg: VQLCMDConfig, data: Data, device, bf16: bool, log) -> Model:
    check_op_backend(cfg)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    try:
        net = get_method(cfg.method).network(cfg, data.den_cfg, data.tokenizer_dir, log=log)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if bf16:
        # DeepSpeed's bf16 module holds frozen tensors (CSDM†'s codebook, a frozen-embedding ablation's table)
        # rounded to bf16, with no fp32 master copy: rounded once here, the fp32 EMAs start from the values
        # the model uses, instead of drifting from the fp32 ones toward them (3.8e-3 on CSDM†'s rows)
        with torch.no_grad():
            for p in net.parameters():
                if not p.requires_grad:
                    p.copy_(p.to(torch.bfloat16))
    teacher, sampling = EMA(net, cfg.ema.teacher), EMA(net, cfg.ema.sampling)
    schedule = ShiftedCosineSchedule(cfg.schedule.shift, cfg.schedule.t_min)
    module = LossModule(net, teacher, schedule, cfg).to(device)
    teacher.module.to(device)
    sampling.module.to(device)
    if cfg.train.fast and bf16:
        # the teacher forward on a bf16 copy of its fp32 EMA (the master), as the student's bf16 weights have
        # DeepSpeed's fp32 partitions: no per-call weight casts under autocast
        teacher.keep_compute_copy(torch.bfloat16)
    if cfg.train.compile and not cfg.train.fast:
        # in place: torch.compile(module) would wrap it, and its state-dict keys (_orig_mod.*) would no longer
        # match a checkpoint written without compile, nor the other way round (the fast step's: build_step)
        net.denoiser.compile()
    # checkpoints of compiled runs from before that change hold the wrapper's _orig_mod.* keys
    net.denoiser.register_load_state_dict_pre_hook(_strip_compile_prefix)
    return Model(net, teacher, sampling, schedule, module)


def _strip_compile_prefix(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: ``<prefix>_orig_mod.<name>`` (the keys ``torch.compile(module)`` gave the
    denoiser's weights when the trainer wrapped it) read as ``<prefix><name>``."""
    old = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)


def build_engine(model: Model, cfg: VQLCMDConfig, ds: dict, device, log):
    """The DeepSpeed engine around the loss module, with AdamW and the warm-up + cosine schedule."""
    import deepspeed

    optimizer = build_optimizer(model.module.parameters(), cfg.optimizer, device)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(model=model.module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds)
    log(release_freed_memory())  # the weights' first copy, now in DeepSpeed's flat buffers
    return engine


def build_flat_step(model: Model, engine, cfg: VQLCMDConfig, device, log) -> Optional[FlatStep]:
    """The fast step's gradient-and-update path (``train.step``), and what it compiles (``train.compile``): the
    flat step's loss of the flat weights, or DeepSpeed's step's whole loss module (in place). Both compile the
    student forward (and, through AOTAutograd, its backward), the teacher forward and the fused ops between;
    the flat step takes the method's draws before its graph, DeepSpeed's step draws inside (graph breaks):
    the random streams are the default step's either way. None: DeepSpeed's engine steps; the log says why."""
    t = cfg.train
    if not t.fast:
        return None
    reason = "train.step is 'deepspeed'" if t.step == "deepspeed" else flat_step_refusal(engine)
    if reason and t.step == "flat":
        raise ConfigError(f"train.step 'flat' cannot drive this run: {reason}")
    graphs = t.compile and t.cuda_graphs and device.type == "cuda"
    if t.cuda_graphs and not graphs:
        log("warning: train.cuda_graphs is on but " + ("train.compile is off" if not t.compile else
                                                        f"the device is {device.type}") + ": no CUDA graphs")
    if reason:
        log(f"step: DeepSpeed's engine ({reason})")
        if t.compile:
            model.module.compile()
        return None
    log("step: flat (one gradient buffer, clipped and stepped on DeepSpeed's flat ZeRO buffers"
        + (", CUDA graphs" if graphs else "") + ")")
    return FlatStep(engine, compile_loss=t.compile, cuda_graphs=graphs, backend=t.backend)


def attention_words(den_cfg, device, bf16: bool) -> str:
    """Which attention kernel trains the model, for the log: a query shaped like the model's attention's
    (1, heads, M, head dim), asked of the backend choice with the model's dropout."""
    probe = torch.empty(1, den_cfg.heads, den_cfg.seq_len, den_cfg.width // den_cfg.heads, device=device,
                        dtype=torch.bfloat16 if bf16 else torch.float32)
    attn = resolved_backend(den_cfg.attention_backend, probe, den_cfg.attn_dropout)
    if attn == "sdpa":
        attn = "sdpa/" + sdpa_kernel_for(probe, den_cfg.attn_dropout)
    return attn


def run_length_warnings(cfg: VQLCMDConfig) -> list:
    """Settings that a run of ``train.steps`` steps cannot play out, as a shipped config shrunk with
    ``--set train.steps=20`` gives: it trained inside its warm-up and exported near-initial weights."""
    steps, warnings = cfg.train.steps, []
    if cfg.optimizer.warmup_steps >= steps:
        warnings.append(f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} >= train.steps {steps}: the run ends "
                        "inside its warm-up, below optimizer.lr")
    decay = cfg.ema.sampling  # the exported weights (the teacher's lag is what a consistency target is)
    if decay > 0 and decay ** steps > 0.1:  # an EMA of rate η keeps η^n of its start after n steps
        warnings.append(f"ema.sampling {decay} keeps {100 * decay ** steps:.0f}% of the initial weights after "
                        f"train.steps {steps} (it averages over ~{1 / (1 - decay):.0f} steps): the exported "
                        "pipeline samples from near its start")
    return warnings
