"""The training engine: DeepSpeed (ZeRO 1/2 in bf16 or fp32, ZeRO 0 in fp32) around the VQ-LCMD loss.

Parallelism, checkpoints and logging live here; the model (``vqlcmd.model``)
and the diffusion math (``vqlcmd.diffusion``) know nothing of them.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from ..baselines import MaskGITPipeline, apply_method, build_network, maskgit_losses
from ..diffusion import training_losses
from ..ema import EMA
from ..embedding import collapse_indicator
from ..model import attention_backend_for, preset_config
from ..model.attention import sdpa_kernel_for
from ..network import VQLCMDNetwork
from ..pipeline import VQLCMDPipeline
from ..schedule import ShiftedCosineSchedule
from . import checkpoint as ckpt
from . import fast
from .config import ConfigError, VQLCMDConfig, check_deepspeed_section, repo_path
from .data import check_data_paths, open_data
from .distributed import (agree_on_setup, barrier, data_fingerprint, data_identity, exchanged, init_distributed,
                          mean_over_ranks)
from .host_memory import keep_freed_memory, release_freed_memory
from .optim import build_optimizer, build_scheduler
from .precision import resolve_bf16


class NonFiniteLossError(RuntimeError):
    pass


def _signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum else "another rank's signal"  # None: learnt from another rank


def _zero_stage(ds: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (a run's, or a checkpoint's saved one)."""
    return (ds.get("zero_optimization") or {}).get("stage", 0)


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


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM (Ctrl-C, a preempted job) stopped the run at a step boundary, after a checkpoint."""

    def __init__(self, signum: Optional[int], step: int, where: Path):
        self.signum = signum  # None on a rank that learnt of another rank's signal
        super().__init__(f"stopped by {_signal_name(signum)} after step {step}; checkpoint {where}: launch the same "
                         "command again to resume")


class LossModule(nn.Module):
    """What DeepSpeed wraps: the trained network plus a *reference* to the EMA teacher.

    The teacher is kept out of the module tree (``object.__setattr__``) so that
    DeepSpeed neither optimises nor partitions it.
    """

    def __init__(self, net: VQLCMDNetwork, teacher: EMA, schedule, cfg: VQLCMDConfig):
        super().__init__()
        self.net = net
        object.__setattr__(self, "teacher", teacher)
        self.schedule, self.loss_cfg, self.backend = schedule, cfg.loss, cfg.train.backend
        self.method, self.maskgit_cfg = cfg.method, cfg.maskgit

    def forward(self, tokens, labels, generator=None):
        if self.method == "maskgit":
            return maskgit_losses(self.net, tokens, labels, self.maskgit_cfg, label_drop=self.loss_cfg.label_drop,
                                  generator=generator)
        return training_losses(self.net, self.teacher.compute, self.schedule, tokens, labels, self.loss_cfg,
                               generator=generator, backend=self.backend)


def _strip_compile_prefix(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: ``<prefix>_orig_mod.<name>`` (the keys ``torch.compile(module)`` gave the
    denoiser's weights, as the trainer compiled it until in-place compiling replaced that) read as
    ``<prefix><name>``."""
    old = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)


def _setup(key: str, section):
    """What a ``vqlcmd.<key>`` section builds, for comparing a checkpoint's with a run's: the model section as
    its denoiser config (so ``{"depth": 2}`` on a depth-2 preset is no change), others as they are."""
    if key == "model":
        try:
            cfg = preset_config(section["preset"], **section["overrides"])
        except (KeyError, TypeError, ValueError):  # a preset or field this version no longer has: compare the text
            return section
        # how attention and the norms are computed changes neither the weights nor the function
        return replace(cfg, attention_backend="auto", norm_impl="torch")
    return section


def _differences(then, now, prefix: str) -> dict:
    """{dotted key: (then, now)} for the leaves that differ between two JSON-like configs. A key on one side
    only is no difference: a checkpoint from before the key existed (or one this version retired)."""
    if then is None:
        return {}
    if isinstance(then, dict) and isinstance(now, dict):
        out = {}
        for k in sorted(set(then) & set(now), key=str):
            out.update(_differences(then[k], now[k], f"{prefix}.{k}"))
        return out
    return {} if then == now else {prefix: (then, now)}


class Trainer:
    def __init__(self, ds_config: dict, cfg: VQLCMDConfig, *, log=print, progress: bool = True):
        """``progress``: the bars of the digits data set's first preparation (``train`` takes its own)."""
        import deepspeed

        # the method's switches, for a config built or edited in code too (a file's are forced as it is parsed):
        # dataclasses.replace(cfg, method="csdm") trained the full VQ-LCMD loss under the name csdm
        try:
            cfg = apply_method(cfg)
        except ValueError as exc:
            raise ConfigError(f"vqlcmd.{exc}") from exc
        self.cfg = cfg
        check_deepspeed_section(ds_config, "the DeepSpeed config", warn=False)  # (ZeRO-3 too, when built in code)
        if cfg.data.dataset is None:  # path errors are reported before any process group is set up
            check_data_paths(cfg.data)
        self.rank, self.world, self.local_rank, self.device = init_distributed()
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        if self.device.type == "cpu":  # before the tokenizer and the model allocate anything large
            self.log(keep_freed_memory())
        self.out_dir = repo_path(cfg.train.output_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"

        # ---- data ----------------------------------------------------------------------------
        # Each rank opens its own shards (or image tree); one exchange then stops every rank when one failed
        # (the others would wait for it in DeepSpeed's set-up) and refuses ranks that opened different data.
        error = fingerprint = None
        try:
            self.data = open_data(cfg.data, self.rank, local_rank=self.local_rank, device=self.device, log=self.log,
                                  progress=progress)
            self.dataset, tok_dir = self.data.dataset, self.data.tokenizer_dir
            self.tokenizer_dir = tok_dir
            if tok_dir is None and cfg.train.sample_every:
                self.log("no data.tokenizer: the sample grids (train.sample_every) are off, since tokens cannot be "
                         "decoded; the exported pipeline samples tokens only (output_type='tokens')")
            header = self.data.header
            den_cfg = preset_config(cfg.model.preset, **cfg.model.overrides)
            den_cfg = self._check_against_shards(den_cfg, header, self.data.where)
            fingerprint = data_fingerprint(header)
        except Exception as exc:
            if exchanged(exc):  # rank 0's digits preparation failed: every rank knows already
                raise
            error = exc
        agree_on_setup(error, fingerprint)
        self.header = header

        # ---- batch sizes (DeepSpeed's keys are the truth; fill in what it can derive) ------------
        ds = dict(ds_config)
        micro = ds.get("train_micro_batch_size_per_gpu")
        gas = ds.get("gradient_accumulation_steps", 1)
        total = ds.get("train_batch_size")
        if micro is None:
            if total is None:
                raise ConfigError("set train_micro_batch_size_per_gpu or train_batch_size in the config")
            micro = total // (gas * self.world)
            if micro < 1:
                raise ConfigError(f"train_batch_size={total} cannot give each of {self.world} rank(s) "
                                  f"a micro-batch over gradient_accumulation_steps={gas}")
            if micro * gas * self.world != total:  # it trained at the rounded-down batch, silently
                raise ConfigError(
                    f"train_batch_size={total} is not a multiple of {self.world} rank(s) x gradient_accumulation_steps="
                    f"{gas}: set a train_batch_size that is (e.g. {micro * gas * self.world}), or set "
                    "train_micro_batch_size_per_gpu instead")
        elif total is not None and micro * gas * self.world != total:  # DeepSpeed's own rule; it was dropped unread
            raise ConfigError(
                f"train_batch_size={total} but train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps="
                f"{gas} x {self.world} rank(s) = {micro * gas * self.world}: remove one of the keys or make them agree")
        ds["train_micro_batch_size_per_gpu"] = micro
        ds["gradient_accumulation_steps"] = gas
        ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
        ds.setdefault("zero_allow_untested_optimizer", True)  # torch AdamW as the client optimizer
        ds.setdefault("steps_per_print", 10**9)  # our own logging
        self.micro, self.gas = micro, gas
        # DeepSpeed takes a bool: "auto" becomes one here, and the run's config records which
        self.bf16, bf16_why = resolve_bf16(ds.get("bf16", {}).get("enabled", False), self.device)
        ds["bf16"] = {**ds.get("bf16", {}), "enabled": self.bf16}
        if cfg.train.fast:  # DeepSpeed's per-step checks and syncs that it replaces or has no use for
            fast.deepspeed_settings(ds)
        if self.bf16 and _zero_stage(ds) == 0:
            if not self._resumes_zero0_bf16():
                raise ConfigError(
                    f"zero_optimization.stage 0 with bf16 ({bf16_why}) is not supported: DeepSpeed then wraps the "
                    "optimizer in its FP16_UnfusedOptimizer, which takes one AdamW step on zero gradients as it "
                    "starts (Adam's bias correction runs a step ahead, weight decay applies once before training; "
                    "the loss was 4% higher after 12 steps) and reduces gradients in bf16. Use stage 1 (on one "
                    "rank the same training as 0) or 2, or bf16.enabled false")
            self.log("warning: resuming a ZeRO 0 bf16 run, which is no longer accepted for new runs: DeepSpeed's "
                     "FP16_UnfusedOptimizer took one AdamW step on zero gradients as that run started (its "
                     "later steps are sound); train new runs at stage 1 or 2")
        self._check_output_dir(ds)  # before anything is built or written there

        # ---- model, EMAs, optimizer -------------------------------------------------------------
        torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
        try:
            net = build_network(cfg, den_cfg, tok_dir, log=self.log)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        den_cfg = net.config
        if self.bf16:
            # DeepSpeed's bf16 module holds frozen tensors (CSDM†'s codebook, a frozen-embedding ablation's table)
            # rounded to bf16, with no fp32 master copy: rounded once here, the fp32 EMAs start from the values
            # the model uses, instead of drifting from the fp32 ones toward them (3.8e-3 on CSDM†'s rows)
            with torch.no_grad():
                for p in net.parameters():
                    if not p.requires_grad:
                        p.copy_(p.to(torch.bfloat16))
        self.teacher = EMA(net, cfg.ema.teacher)
        self.sampling_ema = EMA(net, cfg.ema.sampling)
        self.schedule = ShiftedCosineSchedule(cfg.schedule.shift, cfg.schedule.t_min)
        module = LossModule(net, self.teacher, self.schedule, cfg).to(self.device)
        self.teacher.module.to(self.device)
        self.sampling_ema.module.to(self.device)
        if cfg.train.fast and self.bf16:
            # the teacher forward on a bf16 copy of its fp32 EMA (the master), as the student's bf16 weights have
            # DeepSpeed's fp32 partitions: no per-call weight casts under autocast
            self.teacher.keep_compute_copy(torch.bfloat16)
        if cfg.train.compile:
            # in place: torch.compile(module) would wrap it, and its state-dict keys (_orig_mod.*) would no
            # longer match a checkpoint written without compile, nor the other way round. The fast step compiles
            # the whole loss: student forward (and, through AOTAutograd, its backward), the teacher forward and
            # the fused ops in between; the generator's draws stay eager (graph breaks), so the random
            # streams are the default step's
            (module if cfg.train.fast else net.denoiser).compile()
        # checkpoints of compiled runs from before that change hold the wrapper's _orig_mod.* keys
        net.denoiser.register_load_state_dict_pre_hook(_strip_compile_prefix)
        optimizer = build_optimizer(module.parameters(), cfg.optimizer, self.device)
        scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.train.steps)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=ds)
        self.net: VQLCMDNetwork = self.engine.module.net
        self.log(release_freed_memory())  # the weights' first copy, now in DeepSpeed's flat buffers
        # Attention dropout draws from the global generator, seeded alike above for equal initial weights: each
        # rank now gets its own stream, or every data-parallel rank would drop the same attention weights.
        torch.manual_seed(int(np.random.SeedSequence([cfg.train.seed, self.rank]).generate_state(1)[0]))
        try:
            self.loader = self.data.loader(micro, rank=self.rank, world_size=self.world, seed=cfg.train.seed)
        except ValueError as exc:  # the data set cannot fill a micro-batch on every rank
            raise ConfigError(f"train_micro_batch_size_per_gpu={micro}: {exc}") from exc
        # per-rank stream for t, s, ε, drop masks: reproducible and saved with checkpoints
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.train.seed * 1000 + self.rank)
        self.step = 0
        self.step_lr, self.own_grad_norm = 0.0, None
        self.signal_seen, self.stop_agreed = None, False  # a SIGINT / SIGTERM on this rank; on any rank
        self.pending, self.bad_grads = [], torch.zeros((), dtype=torch.bool, device=self.device)  # train.fast's
        attn = den_cfg.attention_backend
        # a query shaped like the model's attention's: (1, heads, M, head dim)
        probe = torch.empty(1, den_cfg.heads, den_cfg.seq_len, den_cfg.width // den_cfg.heads, device=self.device,
                            dtype=torch.bfloat16 if self.bf16 else torch.float32)
        if attn == "auto":  # what auto takes for this model's attention
            attn = attention_backend_for(probe, den_cfg.attn_dropout)
        if attn == "sdpa":  # which of SDPA's kernels takes the model's attention, with its dropout, in training
            attn = "sdpa/" + sdpa_kernel_for(probe, den_cfg.attn_dropout)
        self.log(f"vqlcmd: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M parameters, preset "
                 f"{cfg.model.preset}, method {cfg.method}, K={den_cfg.codebook_size} M={den_cfg.seq_len} "
                 f"D={den_cfg.embed_dim}, "
                 f"{self.world} rank(s) x micro-batch {micro} x accumulation {gas}, ZeRO stage "
                 f"{_zero_stage(ds)}, {'bf16' if self.bf16 else 'fp32'} ({bf16_why}), "
                 f"attention {attn}, device {self.device}"
                 + (", fast step" + (" compiled" if cfg.train.compile else "") if cfg.train.fast else ""))
        for warning in run_length_warnings(cfg):
            self.log(f"warning: {warning}")
        self.tb = None
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # a bare GPU image: metrics.jsonl holds the same scalars
                self.log("tensorboard is not installed: no event files (the scalars go to metrics.jsonl)")
            else:
                self.tb = SummaryWriter(str(self.out_dir / "tb"))
        self.resolved_config = {**ds, "vqlcmd": cfg.to_dict()}
        self.resumes: list = []  # the resumes that changed settings, oldest first (see load)
        # a resume's config.json waits until its checkpoint has loaded and it has steps to train (see train):
        # written here, a resume refused later, or one with nothing to do, left it describing weights it never
        # trained
        if not (cfg.train.resume and ckpt.latest_tag(self.ckpt_dir)):
            self._write_run_config()

    def _write_run_config(self) -> None:
        if self.rank == 0:
            (self.out_dir / "config.json").write_text(json.dumps(self.resolved_config, indent=2))

    # ---- checks -------------------------------------------------------------------------------
    def _check_against_shards(self, den_cfg, header: dict, where: str):
        """``where``: the data as errors name it ("the shards in X", "the images under X (...)")."""
        K, grid = int(header["codebook_size"]), header["grid"]
        M = int(grid[0]) * int(grid[1])
        C = int(header.get("num_classes") or 0)
        over = self.cfg.model.overrides
        for key, value in (("codebook_size", K), ("seq_len", M)):
            if key in over and over[key] != value:
                raise ConfigError(f"vqlcmd.model.overrides.{key}={over[key]} but {where} hold "
                                  f"{key}={value} (tokenizer {header.get('tokenizer_id')})")
        if den_cfg.codebook_size != K or den_cfg.seq_len != M:
            raise ConfigError(
                f"preset {self.cfg.model.preset!r} expects codebook_size={den_cfg.codebook_size} and "
                f"{den_cfg.seq_len} tokens per image, but {where} hold codebook_size={K} and "
                f"{M} tokens (tokenizer {header.get('tokenizer_id')}); use a matching preset or shards")
        if den_cfg.num_classes not in (0, C):
            raise ConfigError(f"preset {self.cfg.model.preset!r} has {den_cfg.num_classes} classes but {where} "
                              f"have {C}; set vqlcmd.model.overrides.num_classes")
        if self.cfg.data.tokenizer and self.cfg.data.source == "shards":  # (images: the header is the tokenizer's)
            from ..tokenizer import load_tokenizer

            tok = load_tokenizer(repo_path(self.cfg.data.tokenizer))
            if tok.codebook_size != K:  # the likelier slip than a retrained tokenizer: name the sizes
                raise ConfigError(f"vqlcmd.data.tokenizer {self.cfg.data.tokenizer} has codebook_size "
                                  f"{tok.codebook_size} but {where} hold codebook_size={K} (made by tokenizer "
                                  f"{header.get('tokenizer_id')}); give the tokenizer that wrote them")
            if tok.identifier != header.get("tokenizer_id"):
                raise ConfigError(f"vqlcmd.data.tokenizer {self.cfg.data.tokenizer} has identifier {tok.identifier} "
                                  f"but {where} were made by {header.get('tokenizer_id')}")
        return den_cfg

    # ---- one step -----------------------------------------------------------------------------
    def train_step(self, batches) -> dict:
        if self.cfg.train.fast:  # the terms come back unread: fast.flush reads them
            return fast.train_step(self, batches)
        terms = {}
        self.step_lr = self.engine.get_lr()[0]  # the rate this step uses: the scheduler has moved on by the log
        for micro in range(self.gas):
            tokens, labels = next(batches)
            tokens, labels = tokens.to(self.device), labels.to(self.device)
            if self.net.config.num_classes == 0:
                labels = None
            out = self.engine(tokens, labels, self.generator)
            values = self._read_terms(out)
            self.engine.backward(out["loss"])
            if micro == self.gas - 1 and self._plain_optimizer():
                # the reduced gradients' norm before clipping, as DeepSpeed's, checked at every step: a plain
                # client optimizer (ZeRO 0) steps on non-finite gradients (clipped inf: NaN) where ZeRO 1/2 skip
                # them, and the NaN weights reached the EMAs, the checkpoint and the pipeline with a finite loss
                grads = [q.grad for q in self.engine.module.parameters() if q.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads) if grads else None
                if norm is not None and not torch.isfinite(norm):
                    raise NonFiniteLossError(f"non-finite gradients at step {self.step + 1} (norm {norm.item()}, the "
                                             f"loss finite); stopping without stepping or saving "
                                             f"({self._last_checkpoint_words()})")
                self.own_grad_norm = norm
            skipped = getattr(self.engine, "skipped_steps", 0)
            self.engine.step()
            if getattr(self.engine, "skipped_steps", 0) > skipped:  # ZeRO 1/2's overflow check
                self.log(f"warning: step {self.step + 1}: DeepSpeed skipped the optimizer step (non-finite "
                         "gradients); the step still counts, and the rate schedule falls a step behind")
            for k, v in values.items():
                terms[k] = terms.get(k, 0.0) + v / self.gas
        self.teacher.update(self.net)
        self.sampling_ema.update(self.net)
        self.step += 1
        return terms

    def _plain_optimizer(self) -> bool:
        """Whether DeepSpeed steps a plain client optimizer (ZeRO 0 in fp32): it keeps no grad norm and checks
        no overflow, so the step computes and checks the norm itself."""
        return not hasattr(self.engine.optimizer, "_global_grad_norm")

    def _last_checkpoint_words(self) -> str:
        tag = ckpt.latest_tag(self.ckpt_dir)
        return f"the last checkpoint, {self.ckpt_dir / tag}, is intact" if tag else "no checkpoint was written yet"

    def _flushes_at(self, step: int, stop: int) -> bool:
        """Where the fast step reads its deferred terms: at log steps, before every save or grid, at the last
        step, and at once on a signal when there is one rank (with several, all must meet in the collective)."""
        cfg = self.cfg.train
        return (self._logs_at(step) or step == stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                or (cfg.sample_every and step % cfg.sample_every == 0)
                or (self.world == 1 and self.signal_seen is not None))

    def _logs_at(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def _read_terms(self, out: dict) -> dict:
        """The scalar loss terms as floats, averaged over ranks (as the gradients are: rank 0's alone were logged
        before), or NonFiniteLossError (on every rank alike) if one is not finite on any rank.

        One collective and one read-back from the device per micro-step: the terms, the non-finite flag and
        the stop flag travel together (a flag's mean is > 0 if any rank set it). Checking and reading each
        term on its own stalled the host once per term, twice."""
        names = list(out)
        values = torch.stack([out[k].detach().float().reshape(()) for k in names])
        # the stop flag rides along: every rank learns at the same micro-step that one of them got a signal
        stop = values.new_full((1,), float(self.signal_seen is not None))  # a fill: no host-to-device copy
        host = mean_over_ranks(torch.cat([(~torch.isfinite(values)).any().float().reshape(1), stop, values])).tolist()
        self.stop_agreed = self.stop_agreed or host[1] > 0
        read = dict(zip(names, host[2:]))
        if host[0]:
            bad = {k: v for k, v in read.items() if not math.isfinite(v)}
            raise NonFiniteLossError(
                f"non-finite loss at step {self.step + 1}: term(s) {', '.join(bad) or '(on another rank)'} = "
                f"{bad}; stopping without saving ({self._last_checkpoint_words()})")
        return read

    def train(self, progress: bool = True, until: Optional[int] = None) -> list[dict]:
        """Train to ``train.steps`` (or stop early at step ``until``, saving a checkpoint there, as a
        preempted job would); resumes from the latest checkpoint when ``train.resume``. SIGINT / SIGTERM stop
        it at the next step boundary with a checkpoint: :class:`TrainingInterrupted`."""
        from tqdm.auto import tqdm

        cfg = self.cfg.train
        if cfg.resume and self.load():
            if self.step < cfg.steps:
                self._write_run_config()
            else:  # the pipeline goes on describing the run that trained its weights
                self.resolved_config = self._checkpoint_config
                self.log(f"nothing to train: the checkpoint in {self.ckpt_dir} is at step {self.step} and "
                         f"train.steps is {cfg.steps}; raise train.steps to train on, or set another "
                         "train.output_dir for a new run")
        start = self.step
        stop = cfg.steps if until is None else min(until, cfg.steps)
        history = []
        batches = self.loader.forever()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress or self.rank != 0, desc="train",
                   dynamic_ncols=True)
        self.signal_seen, self.stop_agreed = None, False
        with self._stop_on_signals():  # through the saving too: the deepspeed launcher sends SIGTERM after Ctrl-C
            self._train_loop(stop, batches, bar, history)
            bar.close()
            if self.stop_agreed:
                self.log(f"{_signal_name(self.signal_seen)}: stopping at step {self.step}, saving a checkpoint first "
                         "(Ctrl-C again: stop now, without it)")
            # a finished run launched again trains nothing: its checkpoint stands (saving the same step again
            # would only replace it, and risk it); the pipeline is exported again, in case a crash came between
            if self.step != start or ckpt.latest_tag(self.ckpt_dir) != ckpt.tag_for(self.step):
                self.save()
            elif self.rank == 0:
                self._export_pipeline()
        if self.stop_agreed and self.step < cfg.steps:
            raise TrainingInterrupted(self.signal_seen, self.step, self.ckpt_dir / ckpt.tag_for(self.step))
        return history

    def _stop_on_signals(self):
        """While installed, SIGINT and SIGTERM only set a flag: the loop stops at the next step boundary and the
        run saves a checkpoint, instead of losing the work since the last one (a preempted job gets SIGTERM; under
        the deepspeed launcher Ctrl-C reaches each rank as SIGINT and then as the launcher's SIGTERM, and SLURM
        may send several). A second SIGINT (Ctrl-C again) stops at once, as before."""
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            return contextlib.nullcontext()
        # (None: a handler set outside Python, which could not be put back)
        previous = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) is not None}

        sigints = []

        def ask_to_stop(signum, frame):  # no I/O here: the loop says what happened
            if signum == signal.SIGINT:
                if sigints:  # Ctrl-C again, whatever came between
                    raise KeyboardInterrupt
                sigints.append(signum)
            self.signal_seen = self.signal_seen or signum

        @contextlib.contextmanager
        def installed():
            for s in previous:
                signal.signal(s, ask_to_stop)
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        return installed()

    def _train_loop(self, stop: int, batches, bar, history: list) -> None:
        cfg = self.cfg.train
        # throughput counts the training steps only: a sample grid or checkpoint between two logs made it dip
        train_seconds, step_last = 0.0, self.step
        while self.step < stop and not self.stop_agreed:
            t0 = time.perf_counter()
            terms = self.train_step(batches)  # the default step ends in a read-back of the losses: it is done
            if cfg.fast:  # the flush's read-back ends the steps since the last one: the time is theirs
                if not self._flushes_at(self.step, stop):
                    train_seconds += time.perf_counter() - t0
                    bar.update(1)
                    continue
                rows = fast.flush(self)
                terms = {k: v for k, v in rows[-1].items() if k != "step"}
                history.extend(rows[:-1])
            train_seconds += time.perf_counter() - t0
            history.append({"step": self.step, **terms})
            bar.update(1)
            bar.set_postfix({k: f"{v:.3g}" for k, v in terms.items()})
            if self._logs_at(self.step):
                rate = (self.step - step_last) * self.micro * self.gas * self.world / max(train_seconds, 1e-9)
                train_seconds, step_last = 0.0, self.step
                self._log_scalars(terms, rate)
            # the checkpoint first: a preview that fails (sampling, decoding, a full disk) loses no training
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step != cfg.steps:
                self.save()
            if cfg.sample_every and self.step % cfg.sample_every == 0 and self.step != cfg.steps:
                self.save_sample_grid()

    def _log_scalars(self, terms: dict, images_per_s: float) -> None:
        if self.rank != 0:
            return
        gn = self.engine.get_global_grad_norm()
        gn = self.own_grad_norm if gn is None else gn
        # the log steps' scalars as JSON lines too: readable without tensorboard (the GPU check's throughput rows)
        row = {"step": self.step, **terms, "lr": self.step_lr, "images_per_s": images_per_s,
               "grad_norm": None if gn is None else float(gn), "micro_batch": self.micro, "ranks": self.world}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is None:
            return
        for k, v in terms.items():
            self.tb.add_scalar(f"loss/{k}", v, self.step)
        if gn is not None:
            self.tb.add_scalar("train/grad_norm", float(gn), self.step)
        self.tb.add_scalar("train/lr", self.step_lr, self.step)
        self.tb.add_scalar("train/images_per_s", images_per_s, self.step)
        self.tb.add_scalar("train/tokens_per_s", images_per_s * self.net.config.seq_len, self.step)
        K = self.net.config.codebook_size
        table = self.net.embedding.table()[:K].detach().float()
        self.tb.add_scalar("embedding/collapse_indicator", collapse_indicator(table), self.step)
        # L_DM and L_CM are sums over tokens of squared distances between embeddings, so they grow with the
        # table's scale: read their curves beside it (a growing norm is the shortcut dropping is meant to stop)
        self.tb.add_scalar("embedding/mean_row_norm", float(table.norm(dim=-1).mean()), self.step)
        self.tb.flush()

    # ---- samples, pipeline --------------------------------------------------------------------
    def pipeline(self) -> VQLCMDPipeline:
        """The sampling-EMA network as a pipeline (tokenizer attached when known)."""
        tokenizer, ref = None, {"grid": list(self.header["grid"]), "identifier": self.header.get("tokenizer_id")}
        if self.tokenizer_dir is not None:
            from ..tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_dir).to(self.device)
            ref["path"] = str(Path(self.tokenizer_dir).resolve())
        s = self.cfg.sample
        if self.cfg.method == "maskgit":
            return MaskGITPipeline(self.sampling_ema.module, self.schedule, maskgit=self.cfg.maskgit,
                                   tokenizer=tokenizer, tokenizer_ref=ref, class_names=self.header.get("class_names"),
                                   sample_defaults={"num_steps": self.cfg.maskgit.num_steps,
                                                    "guidance_scale": s.guidance_scale},
                                   extra_config=self._pipeline_record())
        return VQLCMDPipeline(self.sampling_ema.module, self.schedule, tokenizer=tokenizer, tokenizer_ref=ref,
                              class_names=self.header.get("class_names"),
                              sample_defaults={"num_steps": s.num_steps, "guidance_scale": s.guidance_scale,
                                               "sampler": s.sampler, "final": s.final,
                                               "guidance_interval": s.guidance_interval},
                              extra_config=self._pipeline_record())

    def _pipeline_record(self) -> dict:
        record = {"training_config": self.resolved_config, "step": self.step}
        if self.resumes:  # settings that changed at a resume: the config holds the last ones only
            record["resumes"] = self.resumes
        return record

    def _untouched_rng(self):
        """Work outside training (loading the tokenizer initialises modules from the global generator) runs in a
        fork of the global RNG: attention dropout draws from it, and a run that wrote a checkpoint or a preview
        must go on exactly as a run resumed from that checkpoint, and as one that wrote neither."""
        return torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])

    def _export_pipeline(self) -> None:
        with self._untouched_rng():
            self.pipeline().save_pretrained(self.out_dir / "pipeline")

    def save_sample_grid(self, path: Optional[Path] = None) -> Optional[Path]:
        """Class-conditional grid (a row per class) from the sampling EMA, saved as PNG (rank 0)."""
        if self.rank != 0 or self.tokenizer_dir is None:
            return None
        with self._untouched_rng():
            return self._sample_grid(path)

    def _sample_grid(self, path: Optional[Path]) -> Path:
        from torchvision.utils import save_image

        pipe = self.pipeline()
        s = self.cfg.sample
        C = self.net.config.num_classes
        g = torch.Generator(device=self.device).manual_seed(1234)
        # previews at sample.grid_steps; MaskGIT's at its own step count (the pipeline's default)
        steps = None if self.cfg.method == "maskgit" else s.grid_steps or s.num_steps
        shown_steps = pipe.sample_defaults["num_steps"] if steps is None else steps
        if C > 0:
            from .report import grid_classes

            labels = grid_classes(C).repeat_interleave(s.per_class)
            images = pipe(labels, output_type="pt", generator=g, num_steps=steps)
        else:
            images = pipe(num_images=8 * s.per_class, output_type="pt", generator=g, num_steps=steps)
        path = path or self.out_dir / "samples" / f"{ckpt.tag_for(self.step)}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_image(images, str(path), nrow=s.per_class, padding=1)
        if self.tb is not None:
            from torchvision.utils import make_grid

            self.tb.add_image("samples", make_grid(images, nrow=s.per_class), self.step)
        self.log(f"step {self.step}: sample grid ({shown_steps} sampling steps) -> {path}")
        return path

    # ---- checkpoints --------------------------------------------------------------------------
    def _rank_state(self) -> dict:
        return {"loader": self.loader.state_dict(), "generator": self.generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}

    def save(self) -> None:
        tag = ckpt.tag_for(self.step)
        partial = self.ckpt_dir / f"{tag}.partial"
        client = {"step": self.step, "teacher": self.teacher.state_dict(),
                  "sampling_ema": self.sampling_ema.state_dict(), "config": self.resolved_config}
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=partial.name, client_state=client, save_latest=False)
        torch.save(self._rank_state(), partial / f"rank_{self.rank:05d}_state.pt")
        barrier()
        # every rank looks (so all stop together): on nodes that do not share output_dir, each sees its own files
        missing = [r for r in range(self.world) if not (partial / f"rank_{r:05d}_state.pt").is_file()]
        if missing:
            raise ckpt.CheckpointError(
                f"{partial} lacks the state of rank(s) {missing[:8]} after every rank wrote it: train.output_dir must "
                "be on a filesystem that all nodes share (checkpoints hold every rank's files in one folder)")
        barrier()  # every rank has looked before rank 0 renames the folder
        if self.rank == 0:
            written = {**self.resolved_config, "data": data_identity(self.header)}  # what a resume checks
            if self.resumes:
                written["resumes"] = self.resumes
            (partial / "config.json").write_text(json.dumps(written, indent=2))
            final = ckpt.commit(self.ckpt_dir, self.step, self.cfg.train.keep_checkpoints)
            self._export_pipeline()
            self.log(f"step {self.step}: checkpoint -> {final}; pipeline -> {self.out_dir / 'pipeline'}")
        barrier()

    def _check_output_dir(self, ds: dict) -> None:
        """A run resumes what ``output_dir`` holds, or refuses to start there: a fresh run would write its
        checkpoints beside the earlier run's, and pruning by step number, or the next resume, would then
        take the wrong ones."""
        tag = ckpt.latest_tag(self.ckpt_dir)
        if tag is None:
            return
        if not self.cfg.train.resume:
            raise ConfigError(f"train.resume is false but {self.ckpt_dir} holds an earlier run's checkpoints (latest "
                              f"{tag}); choose another train.output_dir, or move that folder away")
        self._check_resumable(self.ckpt_dir / tag, ds)

    def _resumes_zero0_bf16(self) -> bool:
        """Whether this run resumes a checkpoint trained at ZeRO 0 in bf16 (refused for new runs since; its
        stage and precision cannot change on resume, so it may go on as it was)."""
        tag = ckpt.latest_tag(self.ckpt_dir) if self.cfg.train.resume else None
        saved = self.ckpt_dir / tag / "config.json" if tag else None
        if saved is None or not saved.is_file():
            return False
        try:
            was = json.loads(saved.read_text())
        except (OSError, ValueError):
            return False  # the resume check names the damage
        return _zero_stage(was) == 0 and bool((was.get("bf16") or {}).get("enabled", False))

    def _check_resumable(self, folder: Path, ds: dict) -> None:
        """What a resume would otherwise fail on deep inside DeepSpeed or the loader, named up front.

        DeepSpeed keeps bf16 and fp32 optimizer state in different layouts and fails on a mix with a
        missing-file error ("auto" may also resolve differently on another machine); another model,
        method or embedding setup fails on state-dict keys; another micro-batch, in the loader. Other token
        shards of the same shapes would not fail at all: the model would go on training on them."""
        saved_file = folder / "config.json"
        if not saved_file.is_file():
            return
        saved = json.loads(saved_file.read_text())
        was = bool(saved.get("bf16", {}).get("enabled", False))
        if was != self.bf16:
            name = {True: "bf16", False: "fp32"}
            raise ConfigError(f"{folder} was trained in {name[was]} but this run trains in {name[self.bf16]}; "
                              f"set bf16.enabled to {str(was).lower()} in the config to resume it")
        then_stage, now_stage = _zero_stage(saved), _zero_stage(ds)
        if (then_stage == 0) != (now_stage == 0):  # 1 <-> 2 resume fine; 0 keeps no ZeRO partition files
            raise ConfigError(f"{folder} was trained at zero_optimization.stage {then_stage} but this run has "
                              f"stage {now_stage}; DeepSpeed cannot load one's optimizer state as the other's: "
                              + ("resume with stage 1 or 2" if then_stage else "resume with stage 0"))
        then, now = saved.get("vqlcmd", {}), self.cfg.to_dict()
        seed = then.get("train", {}).get("seed")
        if seed is not None and seed != self.cfg.train.seed:  # the loader's order and the loss's draws follow it
            raise ConfigError(f"{folder} was trained with train.seed {seed} but this run has {self.cfg.train.seed}; "
                              "the data order and the loss's random draws resume from the saved seed's streams, so "
                              "resume with the same seed, or train in another train.output_dir")
        # (another schedule: another method mid-run; CSDM†'s csdm section decides its frozen table, as embedding does)
        keys = ("method", "model", "embedding", "schedule") + (("csdm",) if now["method"] == "csdm_fixed" else ())
        # the objective: weights trained on one loss and resumed on another match neither config (MaskGIT's
        # section is mostly its sampler's; these two keys are its training's)
        objective = {"loss": None, **({"maskgit": ("train_schedule", "label_smoothing")}
                                      if now["method"] == "maskgit" else {})}
        for key, only in objective.items():
            was, has = then.get(key), json.loads(json.dumps(now[key]))
            if only and isinstance(was, dict):
                was, has = ({k: v for k, v in d.items() if k in only} for d in (was, has))
            changed = _differences(was, has, f"vqlcmd.{key}")
            if changed:
                name, (old, new) = next(iter(changed.items()))
                raise ConfigError(f"{folder} was trained with {name} = {json.dumps(old)} but this run has "
                                  f"{json.dumps(new)}; resume with the same {key} settings, or train in another "
                                  "train.output_dir (--set train.output_dir=runs/NAME)")
        for key in keys:
            if key in then and _setup(key, then[key]) != _setup(key, now[key]):
                raise ConfigError(f"{folder} was trained with vqlcmd.{key} = {json.dumps(then[key])} but this run has "
                                  f"{json.dumps(now[key])}; resume with the same, or train in another "
                                  "train.output_dir")
        ranks = len(list(folder.glob("rank_*_state.pt")))  # one per rank that wrote the checkpoint
        if ranks and ranks != self.world:  # DeepSpeed's ZeRO state and the loader's position are per rank
            raise ConfigError(f"{folder} was written by {ranks} rank(s) but this run has {self.world}; resume "
                              f"with the same number (deepspeed --num_gpus {ranks}, or as many nodes x GPUs)")
        data, now_data = saved.get("data"), data_identity(self.header)  # (checkpoints from before lack it)
        if data is not None and data != now_data:
            diff = {k: (data.get(k), now_data.get(k)) for k in sorted(set(data) | set(now_data))
                    if data.get(k) != now_data.get(k)}
            raise ConfigError(f"{folder} was trained on other data (token shards or image tree): "
                              f"{json.dumps(diff)[:600]} (then, now); "
                              "resume on the same data (another tokenizer's ids mean other things to the model), or "
                              "train in another train.output_dir")
        micro = saved.get("train_micro_batch_size_per_gpu")
        if micro is not None and micro != ds["train_micro_batch_size_per_gpu"]:
            raise ConfigError(f"{folder} was trained with train_micro_batch_size_per_gpu={micro} but this run has "
                              f"{ds['train_micro_batch_size_per_gpu']}; the data loader resumes mid-epoch by batch "
                              "count, so resume with the same micro-batch")

    def _apply_config_rates(self) -> None:
        """A checkpoint brings back the optimizer's hyper-parameters, the schedule's base rate and the EMA rates
        with their state; a resume whose config changed them trained on with the old ones, while config.json and
        the pipeline recorded the new. The config wins (lowering the rate on resume is a common fix), and the
        log says what changed."""
        o, changed = self.cfg.optimizer, {}
        sched = self.engine.lr_scheduler
        for i, group in enumerate(self.engine.optimizer.param_groups):
            for key, value in (("betas", tuple(o.betas)), ("weight_decay", o.weight_decay), ("eps", o.eps)):
                current = tuple(group[key]) if key == "betas" else group[key]
                if current != value:
                    changed[f"optimizer.{key}"] = (current, value)
                    group[key] = value
            if sched.base_lrs[i] != o.lr:
                changed["optimizer.lr"] = (sched.base_lrs[i], o.lr)
                sched.base_lrs[i] = o.lr
            group["lr"] = o.lr * sched.lr_lambdas[i](sched.last_epoch)  # the rate of the next step
        for name, ema in (("teacher", self.teacher), ("sampling", self.sampling_ema)):
            if ema.decay != getattr(self.cfg.ema, name):
                changed[f"ema.{name}"] = (ema.decay, getattr(self.cfg.ema, name))
                ema.decay = getattr(self.cfg.ema, name)
        if changed:
            self.log("resuming with the config's " + ", ".join(f"{k} {new} (checkpoint: {old})"
                                                               for k, (old, new) in changed.items()))

    def _record_resume(self, folder: Path) -> None:
        """What the checkpoint's run had that this run changed (the rates, the step count, ...: what the resume
        checks let through): ``resumes`` gains an entry, kept with the next checkpoints and the pipeline."""
        self._checkpoint_config = self.resolved_config
        try:
            saved = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):  # checkpoints from before configs were saved with them
            return
        self.resumes = list(saved.pop("resumes", []))
        saved.pop("data", None)
        self._checkpoint_config = saved
        now = json.loads(json.dumps(self.resolved_config))
        changed = {k[len("config."):]: list(v) for k, v in _differences(saved, now, "config").items()
                   if k != "config.vqlcmd.train.resume"}
        if changed and self.step < self.cfg.train.steps:  # (with nothing to train, nothing changed)
            self.resumes.append({"step": self.step, "changed": changed})
            self.log(f"resuming at step {self.step} with settings other than the checkpoint's (recorded with the "
                     "next checkpoints and the pipeline): " + ", ".join(
                         f"{k} {json.dumps(new)} (was {json.dumps(old)})" for k, (old, new) in changed.items()))

    def load(self) -> bool:
        tag = ckpt.latest_tag(self.ckpt_dir)
        if tag is None:
            return False
        folder = self.ckpt_dir / tag
        self._check_resumable(folder, self.resolved_config)
        try:
            _, client = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
        except Exception as exc:  # a truncated or corrupt file: DeepSpeed/torch name neither the file nor a way out
            raise ckpt.CheckpointError(ckpt.unreadable(folder, exc)) from exc
        if client is None:
            raise ckpt.CheckpointError(ckpt.unreadable(folder, "DeepSpeed found no checkpoint there"))
        self.step = int(client["step"])
        self.teacher.load_state_dict(client["teacher"])
        self.sampling_ema.load_state_dict(client["sampling_ema"])
        self._apply_config_rates()
        self._record_resume(folder)
        rank_file = self.ckpt_dir / tag / f"rank_{self.rank:05d}_state.pt"
        if not rank_file.is_file():
            raise RuntimeError(f"{rank_file} is missing: the checkpoint was written by a run with a different "
                               "number of ranks; resume with the same world size")
        try:
            state = torch.load(rank_file, weights_only=True)
        except Exception as exc:
            raise ckpt.CheckpointError(ckpt.unreadable(folder, exc)) from exc
        self.loader.load_state_dict(state["loader"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])
        self.log(f"resumed from {self.ckpt_dir / tag} at step {self.step}")
        return True
