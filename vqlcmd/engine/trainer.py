"""The trainer: builds a run (``build``), then loops step (``step``) -> maybe log / save (``checkpoint``) /
preview (``outputs``) until ``train.steps``. The model and the diffusion math know nothing of it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from ..methods import apply_method
from .build import attention_words, build_data, build_engine, build_flat_step, build_model_and_emas, run_length_warnings
from .checkpoint import CheckpointError, CheckpointManager, tag_for
from .config import ConfigError, VQLCMDConfig, repo_path
from .data import check_data_paths
from .distributed import data_identity, init_distributed
from .ds_config import build_ds_config, check_deepspeed_section, zero_stage
from .host_memory import keep_freed_memory
from .metrics_log import truncate_metrics
from .outputs import MetricsLog, build_pipeline, sample_grid, untouched_rng
from .signals import TrainingInterrupted, signal_name, stop_on_signals
from .step import NonFiniteLossError, TrainStep
from .streams import SlotStreams

__all__ = ["CheckpointError", "NonFiniteLossError", "Trainer", "TrainingInterrupted", "run_length_warnings"]


class Trainer:
    def __init__(self, ds_config: dict, cfg: VQLCMDConfig, *, log=print, progress: bool = True):
        """``progress``: the bars of the digits data set's first preparation (``train`` takes its own)."""
        try:  # the method's switches, for a config built or edited in code too (a file's are forced as parsed)
            cfg = apply_method(cfg)
        except ValueError as exc:
            raise ConfigError(f"vqlcmd.{exc}") from exc
        self.cfg, t = cfg, cfg.train
        check_deepspeed_section(ds_config, "the DeepSpeed config", warn=False)  # (ZeRO-3 too, when built in code)
        check_data_paths(cfg.data)  # before any process group is set up
        self.rank, self.world, self.local_rank, self.device = init_distributed()
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        if self.device.type == "cpu":  # before the tokenizer and the model allocate anything large
            self.log(keep_freed_memory())
        self.out_dir = repo_path(t.output_dir)
        self.checkpoints = CheckpointManager(self.out_dir, rank=self.rank, world=self.world,
                                             keep=t.keep_checkpoints, resume=t.resume, log=self.log)
        self.ckpt_dir = self.checkpoints.ckpt_dir

        self.data = build_data(cfg, self.rank, self.local_rank, self.device, self.log, progress)
        self.dataset, self.header, self.tokenizer_dir = self.data.source.dataset, self.data.header, self.data.tokenizer_dir
        self.checkpoints.claim()  # one run per folder (refused data above leaves no folder); the verified resume
        run_ds = build_ds_config(ds_config, self.world, self.device, fast=t.fast, log=self.log,
                                 resumes_zero0_bf16=self.checkpoints.resumes_zero0_bf16(),
                                 resumed_batch=self.checkpoints.resumed_batch())
        ds, self.micro, self.gas, self.bf16 = run_ds.ds, run_ds.micro, run_ds.gas, run_ds.bf16
        self.checkpoints.check_output_dir(ds, cfg, self.bf16, data_identity(self.header))  # before anything is built

        model = build_model_and_emas(cfg, self.data, self.device, self.bf16, self.log)
        self.teacher, self.sampling_ema, self.schedule = model.teacher, model.sampling_ema, model.schedule
        self.engine = build_engine(model, cfg, ds, self.device, self.log)
        self.net = self.engine.module.net
        self.streams = SlotStreams(t.seed, self.rank, self.world, self.gas, self.device)  # per data slot
        try:
            self.loader = self.data.source.loader(self.micro, rank=self.rank, world_size=self.world, seed=t.seed,
                                                  accumulation=self.gas)
        except ValueError as exc:  # the data set cannot fill a micro-batch on every rank
            raise ConfigError(f"train_micro_batch_size_per_gpu={self.micro}: {exc}") from exc
        self.stepper = TrainStep(self.engine, [self.teacher, self.sampling_ema], streams=self.streams,
                                 device=self.device, gas=self.gas, deferred=t.fast, log=self.log,
                                 stop_requested=lambda: self.signal_seen is not None,
                                 checkpoint_words=self.checkpoints.last_checkpoint_words,
                                 flat=build_flat_step(model, self.engine, cfg, self.device, self.log))
        self.step, self.signal_seen = 0, None  # (a SIGINT / SIGTERM on this rank)
        den = self.net.config
        self.log(f"vqlcmd: {sum(p.numel() for p in self.net.parameters()) / 1e6:.2f}M parameters, preset "
                 f"{cfg.model.preset}, method {cfg.method}, K={den.codebook_size} M={den.seq_len} D={den.embed_dim}, "
                 f"{self.world} rank(s) x micro-batch {self.micro} x accumulation {self.gas}, ZeRO stage "
                 f"{zero_stage(ds)}, {'bf16' if self.bf16 else 'fp32'} ({run_ds.bf16_why}), "
                 f"attention {attention_words(den, self.device, self.bf16)}, device {self.device}"
                 + (", fast step" + (" compiled" if t.compile else "") if t.fast else ""))
        for warning in run_length_warnings(cfg):
            self.log(f"warning: {warning}")
        self.metrics = MetricsLog(self.out_dir, self.log) if self.rank == 0 else None
        self.tb = self.metrics.tb if self.metrics else None
        self.resolved_config = {**ds, "vqlcmd": cfg.to_dict()}
        self.resumes: list = []  # the resumes that changed settings, oldest first (see load)
        # a resume's config.json waits until its checkpoint has loaded and it has steps to train (see train):
        # written here, a resume refused later, or one with nothing to do, left it describing weights it never
        # trained
        if not (t.resume and self.checkpoints.latest()):
            self._write_run_config()

    step_lr = property(lambda self: self.stepper.step_lr)  # (the rate of the last step)
    own_grad_norm = property(lambda self: self.stepper.own_grad_norm)  # (ZeRO 0's)

    def _write_run_config(self) -> None:
        if self.rank == 0:
            (self.out_dir / "config.json").write_text(json.dumps(self.resolved_config, indent=2))

    def train_step(self, batches) -> dict:
        """One optimizer step; its terms (with ``train.fast``, unread device tensors: the flush reads them)."""
        terms = self.stepper(batches, self.step + 1)
        self.step += 1
        return terms

    def train(self, progress: bool = True, until: Optional[int] = None) -> list[dict]:
        """Train to ``train.steps`` (or stop early at step ``until``, saving a checkpoint there, as a
        preempted job would); resumes from the latest checkpoint when ``train.resume``. SIGINT / SIGTERM stop
        it at the next step boundary with a checkpoint: :class:`TrainingInterrupted`."""
        with self.checkpoints.held():  # the folder is this run's until it returns
            return self._train(progress, until)

    def _train(self, progress: bool, until: Optional[int]) -> list[dict]:
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
        start, stop, history = self.step, cfg.steps if until is None else min(until, cfg.steps), []
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress or self.rank != 0, desc="train",
                   dynamic_ncols=True)
        self.signal_seen, self.stepper.stop_agreed = None, False
        with self._stop_on_signals():  # through the saving too: the deepspeed launcher sends SIGTERM after Ctrl-C
            self._train_loop(stop, self.loader.forever(), bar, history)
            bar.close()
            if self.stepper.stop_agreed:
                self.log(f"{signal_name(self.signal_seen)}: stopping at step {self.step}, saving a checkpoint first "
                         "(Ctrl-C again: stop now, without it)")
            # a finished run launched again trains nothing: its checkpoint stands (saving the same step again
            # would only replace it, and risk it); the pipeline is exported again, in case a crash came between
            if self.step != start or self.checkpoints.latest() != tag_for(self.step):
                self.save()
            elif self.rank == 0:
                self._export_pipeline()
        if self.stepper.stop_agreed and self.step < cfg.steps:
            raise TrainingInterrupted(self.signal_seen, self.step, self.ckpt_dir / tag_for(self.step))
        return history

    def _train_loop(self, stop: int, batches, bar, history: list) -> None:
        cfg = self.cfg.train
        # throughput counts the training steps only: a sample grid or checkpoint between two logs made it dip
        train_seconds, step_last = 0.0, self.step
        while self.step < stop and not self.stepper.stop_agreed:
            t0 = time.perf_counter()
            terms = self.train_step(batches)  # the default step ends in a read-back of the losses: it is done
            if cfg.fast:  # the flush's read-back ends the steps since the last one: the time is theirs
                if not self._flushes_at(self.step, stop):
                    train_seconds += time.perf_counter() - t0
                    bar.update(1)
                    continue
                rows = self.stepper.flush()
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

    def _flushes_at(self, step: int, stop: int) -> bool:
        """Where the fast step reads its deferred terms: at log steps, before every save or grid, at the last
        step, and at once on a signal when there is one rank (with several, all must meet in the collective)."""
        cfg = self.cfg.train
        return (self._logs_at(step) or step == stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                or (cfg.sample_every and step % cfg.sample_every == 0)
                or (self.world == 1 and self.signal_seen is not None))

    def _logs_at(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def _log_scalars(self, terms: dict, images_per_s: float) -> None:
        if self.metrics is not None:
            gn = self.engine.get_global_grad_norm()
            self.metrics.scalars(self.step, terms, self.step_lr, images_per_s, self.own_grad_norm if gn is None else gn,
                                 self.net, {"micro_batch": self.micro, "ranks": self.world})

    def _stop_on_signals(self):
        def seen(signum):
            self.signal_seen = self.signal_seen or signum

        return stop_on_signals(seen)

    # ---- pipeline, previews, checkpoints ----------------------------------------------------------------------
    def pipeline(self):
        """The sampling-EMA network as its method's pipeline (tokenizer attached when known)."""
        record = {"training_config": self.resolved_config, "step": self.step}
        if self.resumes:  # settings that changed at a resume: the config holds the last ones only
            record["resumes"] = self.resumes
        return build_pipeline(self.sampling_ema.module, self.schedule, self.cfg, self.header, self.tokenizer_dir,
                              self.device, record)

    def _untouched_rng(self):
        return untouched_rng(self.device)

    def _export_pipeline(self) -> None:
        with self._untouched_rng():
            self.pipeline().save_pretrained(self.out_dir / "pipeline")

    def save_sample_grid(self, path: Optional[Path] = None) -> Optional[Path]:
        """Class-conditional grid (a row per class) from the sampling EMA, saved as PNG (rank 0)."""
        if self.rank != 0 or self.tokenizer_dir is None:
            return None
        path = path or self.out_dir / "samples" / f"{tag_for(self.step)}.png"
        with self._untouched_rng():
            steps = sample_grid(self.pipeline(), self.cfg, self.net.config.num_classes, path, self.device, self.tb, self.step)
        self.log(f"step {self.step}: sample grid ({steps} sampling steps) -> {path}")
        return path

    def save(self) -> None:
        client = {"step": self.step, "teacher": self.teacher.state_dict(),
                  "sampling_ema": self.sampling_ema.state_dict(), "config": self.resolved_config}
        rank_state = {"loader": self.loader.state_dict(), **self.streams.rank_state()}
        written = {**self.resolved_config, "data": data_identity(self.header)}  # what a resume checks
        if self.resumes:
            written["resumes"] = self.resumes

        def published(final: Path) -> None:
            self._export_pipeline()
            self.log(f"step {self.step}: checkpoint -> {final}; pipeline -> {self.out_dir / 'pipeline'}")

        self.checkpoints.save(self.step, self.engine, client, rank_state, written, published)

    def load(self) -> bool:
        resumed = self.checkpoints.load(self.engine, self.resolved_config, self.cfg, self.bf16,
                                        data_identity(self.header), self.streams.slots)
        if resumed is None:
            return False
        self.step = resumed.step
        self.teacher.load_state_dict(resumed.client["teacher"])
        self.sampling_ema.load_state_dict(resumed.client["sampling_ema"])
        self.checkpoints.apply_config_rates(self.engine, {"teacher": self.teacher, "sampling": self.sampling_ema},
                                            self.cfg)
        self._checkpoint_config, self.resumes = self.checkpoints.record_resume(
            resumed.folder, self.resolved_config, self.step, self.cfg.train.steps)
        if self.rank == 0 and truncate_metrics(self.out_dir / "metrics.jsonl", self.step):
            self.log(f"metrics.jsonl: the rows after step {self.step} (trained again now) are dropped")
        resumed.restore_rank_state(self.loader, self.streams)
        self.log(f"resumed from {resumed.folder} at step {self.step}")
        return True
