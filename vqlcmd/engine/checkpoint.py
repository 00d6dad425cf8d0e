"""A run's checkpoints (``CheckpointManager``): what a resume must match, save, load, and the settings a
resume changed. The folder layout, publishing and verification are ``checkpoint_folder``'s."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from ..methods import get_method
# (CheckpointError, atomic_write_text and the CLI's check: public names of this module before the split)
from .checkpoint_folder import (CheckpointError, atomic_write_text, commit, latest_tag,  # noqa: F401
                                resumable_checkpoint, set_aside_checkpoints, tag_for, unreadable,
                                verify_checkpoints_cli)
from .config import ConfigError
from .distributed import RankSetupError
from .ds_config import zero_stage
from .run_lock import RunLock, RunLockedError
from .safe_load import UnsafeCheckpointError, inert_deepspeed_loads, load_rank_state
from .zero_reshard import ReshardError, load_resharded


def _setup(key: str, section):
    """What a ``vqlcmd.<key>`` section builds, for comparing a checkpoint's with a run's: the model section as
    its denoiser config (so ``{"depth": 2}`` on a depth-2 preset is no change), others as they are."""
    if key == "model":
        from ..model import preset_config

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


@dataclass
class Resumed:
    folder: Path
    step: int
    client: dict  # what save() gave DeepSpeed's client_state: step, EMAs, config
    loader: dict  # the loader's position (global: any rank's file holds it)
    streams: Optional[dict]  # {slot: random streams} of this rank's slots; None: the slots changed (afresh)

    def restore_rank_state(self, loader, streams) -> None:
        try:
            loader.load_state_dict(self.loader)
        except ValueError as exc:  # another global batch mid-epoch, say: named, with the folder
            raise ConfigError(f"{self.folder}: {exc}") from exc
        if self.streams is None:
            streams.reset(step=self.step)
        else:
            streams.load_state_dict(self.streams)


class CheckpointManager:
    """A run's checkpoints: what a resume must match, save, load, and the settings a resume changed.

    A checkpoint holds DeepSpeed's files (model, ZeRO optimizer partitions), the EMAs and the resolved
    config in DeepSpeed's client state, one ``rank_XXXXX_state.pt`` per rank (loader position, RNG states)
    and ``config.json`` (the run's config plus its data's identity: what a resume checks)."""

    def __init__(self, out_dir: Path, *, rank: int, world: int, keep: int, resume: bool, log=print):
        self.out_dir, self.ckpt_dir = out_dir, out_dir / "checkpoints"
        self.rank, self.world, self.keep, self.resume, self.log = rank, world, keep, resume, log
        self.lock = None  # rank 0's RunLock, from claim() until release()

    def latest(self) -> Optional[str]:
        return latest_tag(self.ckpt_dir)

    def last_checkpoint_words(self) -> str:
        tag = self.latest()
        return f"the last checkpoint, {self.ckpt_dir / tag}, is intact" if tag else "no checkpoint was written yet"

    # ---- before anything is built: is there a run to resume, and may this config resume it? -----------------
    def _resumed_config(self) -> tuple[Optional[str], Optional[dict]]:
        """(tag, its config.json) of the checkpoint this run resumes; None for an unreadable config (the resume
        check names the damage) or when there is none."""
        tag = self.latest() if self.resume else None
        try:
            return tag, json.loads((self.ckpt_dir / tag / "config.json").read_text()) if tag else None
        except (OSError, ValueError):
            return tag, None

    def resumes_zero0_bf16(self) -> bool:
        """Whether this run resumes a checkpoint trained at ZeRO 0 in bf16 (see ds_config.build_ds_config)."""
        _, was = self._resumed_config()
        return was is not None and zero_stage(was) == 0 and bool((was.get("bf16") or {}).get("enabled", False))

    def resumed_batch(self) -> Optional[tuple]:
        """(micro-batch, accumulation, ranks) of the checkpoint this run resumes, or None (``ds_config`` keeps
        the global batch on another number of ranks with it)."""
        tag, was = self._resumed_config()
        ranks = len(list((self.ckpt_dir / tag).glob("rank_*_state.pt"))) if was else 0
        if not ranks or "train_micro_batch_size_per_gpu" not in was:
            return None
        return int(was["train_micro_batch_size_per_gpu"]), int(was.get("gradient_accumulation_steps", 1)), ranks

    def check_output_dir(self, ds: dict, cfg, bf16: bool, data: dict) -> None:
        """A run resumes what ``output_dir`` holds, or refuses to start there: a fresh run would write its
        checkpoints beside the earlier run's, and pruning by step number, or the next resume, would then
        take the wrong ones. ``data``: the run's data identity (``distributed.data_identity``)."""
        tag = self.latest()
        aside = [p.name for p in set_aside_checkpoints(self.ckpt_dir)]  # (an earlier run's too, if damaged)
        if not self.resume and (tag or aside):
            raise ConfigError(f"train.resume is false but {self.ckpt_dir} holds an earlier run's checkpoints (latest "
                              f"{tag or aside[0]}); choose another train.output_dir, or move that folder away")
        if tag is None:
            return
        self.check_resumable(self.ckpt_dir / tag, ds, cfg, bf16, data)

    def claim(self) -> None:
        """Rank 0 takes the folder's run lock (one run per folder: ``run_lock``) and, resuming, verifies the
        newest checkpoint against its manifest, setting aside those that fail (``resumable_checkpoint``).
        Every rank then sees ``latest`` name the one that verified, or stops with rank 0's one-line error."""
        import torch.distributed as dist

        error = caught = None
        if self.rank == 0:
            try:
                self.lock = RunLock(self.out_dir, log=self.log).acquire()
                if self.resume:
                    resumable_checkpoint(self.ckpt_dir, log=self.log)
            except (CheckpointError, RunLockedError) as exc:
                caught, error = exc, str(exc)
        if dist.is_available() and dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if caught is not None:
            raise caught
        if error:
            raise RankSetupError(f"rank 0 stopped: {error}")

    @contextlib.contextmanager
    def held(self):
        """The run lock held until the block ends (taken again for a trainer that trains on after a return)."""
        if self.rank == 0 and self.lock is None:
            self.lock = RunLock(self.out_dir, log=self.log).acquire()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def check_resumable(self, folder: Path, ds: dict, cfg, bf16: bool, data: dict) -> None:
        """What a resume would otherwise fail on deep inside DeepSpeed or the loader, named up front.

        DeepSpeed keeps bf16 and fp32 optimizer state in different layouts and fails on a mix with a
        missing-file error ("auto" may also resolve differently on another machine); another model,
        method or embedding setup fails on state-dict keys. Other token shards of the same shapes would not
        fail at all: the model would go on training on them. Another number of ranks is no difference: the
        ZeRO state is laid out anew (``zero_reshard``), the data position is global (``data/loader.py``)."""
        saved_file = folder / "config.json"
        if not saved_file.is_file():
            return
        try:  # (a checkpoint from before manifests: nothing verified it)
            saved = json.loads(saved_file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(unreadable(folder, f"{saved_file.name}: {exc}")) from exc
        was = bool(saved.get("bf16", {}).get("enabled", False))
        if was != bf16:
            name = {True: "bf16", False: "fp32"}
            raise ConfigError(f"{folder} was trained in {name[was]} but this run trains in {name[bf16]}; "
                              f"set bf16.enabled to {str(was).lower()} in the config to resume it")
        then_stage, now_stage = zero_stage(saved), zero_stage(ds)
        if (then_stage == 0) != (now_stage == 0):  # 1 <-> 2 resume fine; 0 keeps no ZeRO partition files
            raise ConfigError(f"{folder} was trained at zero_optimization.stage {then_stage} but this run has "
                              f"stage {now_stage}; DeepSpeed cannot load one's optimizer state as the other's: "
                              + ("resume with stage 1 or 2" if then_stage else "resume with stage 0"))
        then, now = saved.get("vqlcmd", {}), cfg.to_dict()
        seed = then.get("train", {}).get("seed")
        if seed is not None and seed != cfg.train.seed:  # the loader's order and the loss's draws follow it
            raise ConfigError(f"{folder} was trained with train.seed {seed} but this run has {cfg.train.seed}; "
                              "the data order and the loss's random draws resume from the saved seed's streams, so "
                              "resume with the same seed, or train in another train.output_dir")
        method = get_method(now["method"])
        # the objective: weights trained on one loss and resumed on another match neither config
        for key, only in method.objective.items():
            was, has = then.get(key), json.loads(json.dumps(now[key]))
            if only and isinstance(was, dict):
                was, has = ({k: v for k, v in d.items() if k in only} for d in (was, has))
            changed = _differences(was, has, f"vqlcmd.{key}")
            if changed:
                name, (old, new) = next(iter(changed.items()))
                raise ConfigError(f"{folder} was trained with {name} = {json.dumps(old)} but this run has "
                                  f"{json.dumps(new)}; resume with the same {key} settings, or train in another "
                                  "train.output_dir (--set train.output_dir=runs/NAME)")
        # (another schedule: another method mid-run)
        for key in ("method", "model", "embedding", "schedule") + method.resume_sections:
            if key in then and _setup(key, then[key]) != _setup(key, now[key]):
                raise ConfigError(f"{folder} was trained with vqlcmd.{key} = {json.dumps(then[key])} but this run has "
                                  f"{json.dumps(now[key])}; resume with the same, or train in another "
                                  "train.output_dir")
        ranks = len(list(folder.glob("rank_*_state.pt")))  # one per rank that wrote the checkpoint
        micro, gas = saved.get("train_micro_batch_size_per_gpu"), saved.get("gradient_accumulation_steps", 1)
        then_batch, now_batch = (micro or 0) * gas * ranks, ds["train_micro_batch_size_per_gpu"] * \
            ds["gradient_accumulation_steps"] * self.world
        if micro is not None and ranks and then_batch != now_batch:  # the loader resumes by whole global batches
            raise ConfigError(f"{folder} was trained at a global batch of {then_batch} ({ranks} rank(s) x micro-batch "
                              f"{micro} x accumulation {gas}) but this run's is {now_batch}; the data position "
                              f"resumes in whole global batches: set train_batch_size {then_batch}")
        then_data = saved.get("data")  # (checkpoints from before lack it)
        if then_data is not None and then_data != data:
            diff = {k: (then_data.get(k), data.get(k)) for k in sorted(set(then_data) | set(data))
                    if then_data.get(k) != data.get(k)}
            raise ConfigError(f"{folder} was trained on other data (token shards or image tree): "
                              f"{json.dumps(diff)[:600]} (then, now); "
                              "resume on the same data (another tokenizer's ids mean other things to the model), or "
                              "train in another train.output_dir")

    # ---- save and load --------------------------------------------------------------------------------------
    def save(self, step: int, engine, client: dict, rank_state: dict, written_config: dict,
             on_commit: Callable[[Path], None]) -> None:
        """Every rank writes into ``<tag>.partial``; once all have, rank 0 writes ``config.json``, publishes
        the folder (``commit``) and calls ``on_commit(final)`` (the pipeline export)."""
        from .distributed import barrier

        partial = self.ckpt_dir / f"{tag_for(step)}.partial"
        engine.save_checkpoint(str(self.ckpt_dir), tag=partial.name, client_state=client, save_latest=False)
        torch.save(rank_state, partial / f"rank_{self.rank:05d}_state.pt")
        barrier()
        # every rank looks (so all stop together): on nodes that do not share output_dir, each sees its own files
        missing = [r for r in range(self.world) if not (partial / f"rank_{r:05d}_state.pt").is_file()]
        if missing:
            raise CheckpointError(
                f"{partial} lacks the state of rank(s) {missing[:8]} after every rank wrote it: train.output_dir must "
                "be on a filesystem that all nodes share (checkpoints hold every rank's files in one folder)")
        barrier()  # every rank has looked before rank 0 renames the folder
        if self.rank == 0:
            (partial / "config.json").write_text(json.dumps(written_config, indent=2))
            on_commit(commit(self.ckpt_dir, step, self.keep))
        barrier()

    def load(self, engine, ds: dict, cfg, bf16: bool, data: dict, slots: list) -> Optional[Resumed]:
        """The latest checkpoint into ``engine``, checked first; None when there is none. ``slots``: this
        rank's data slots (``SlotStreams.slots``), whose random streams it takes from the files that hold them."""
        tag = self.latest()
        if tag is None:
            return None
        folder = self.ckpt_dir / tag
        self.check_resumable(folder, ds, cfg, bf16, data)
        then = len(list(folder.glob("rank_*_state.pt"))) or self.world  # the ranks that wrote it
        reshard = then != self.world and zero_stage(ds) > 0  # (ZeRO 0 keeps the whole optimizer in one file)
        try:  # every file DeepSpeed reads, weights-only: a file a user was handed runs no code
            with inert_deepspeed_loads(engine):
                _, client = engine.load_checkpoint(str(self.ckpt_dir), tag=tag, load_optimizer_states=not reshard)
            if reshard and client is not None:
                load_resharded(engine, folder)
        except ReshardError as exc:
            raise ConfigError(f"{folder} was written by {then} rank(s), this run has {self.world}: {exc}") from exc
        except UnsafeCheckpointError as exc:  # named, and nothing ran: no "truncated or corrupt" advice
            raise CheckpointError(str(exc)) from exc
        except Exception as exc:  # a truncated or corrupt file: DeepSpeed/torch name neither the file nor a way out
            raise CheckpointError(unreadable(folder, exc)) from exc
        if client is None:
            raise CheckpointError(unreadable(folder, "DeepSpeed found no checkpoint there"))
        if then != self.world:
            self.log(f"resuming {folder.name}, written by {then} rank(s), on {self.world}: the optimizer state "
                     f"{'laid out anew' if reshard else 'whole (ZeRO 0)'}, the data position global")
        states = self._rank_states(folder, then, slots)
        loader = states[self.rank if then == self.world else 0]["loader"]
        return Resumed(folder, int(client["step"]), client, loader, self._streams(folder, ds, then, slots, states))

    def _rank_states(self, folder: Path, then: int, slots: list) -> dict:
        """{rank that wrote it: its rank file}, for the files this rank needs: its own (or rank 0's) and those
        of the ranks that held its slots (slot v was rank v mod ``then``'s)."""
        wanted = {self.rank if then == self.world else 0} | {v % then for v in slots}
        out = {}
        for r in sorted(wanted):
            rank_file = folder / f"rank_{r:05d}_state.pt"
            if not rank_file.is_file():
                raise CheckpointError(unreadable(folder, f"{rank_file.name} is missing"))
            try:
                out[r] = load_rank_state(rank_file)
            except UnsafeCheckpointError as exc:
                raise CheckpointError(str(exc)) from exc
            except Exception as exc:
                raise CheckpointError(unreadable(folder, exc)) from exc
        return out

    def _streams(self, folder: Path, ds: dict, then: int, slots: list, states: dict) -> Optional[dict]:
        """This rank's slots' saved streams, where the checkpoint had the same slots (as many, of the same
        micro-batch); None where it had not: they start afresh (engine/streams.py)."""
        try:
            saved = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            saved = {}
        micro, gas = saved.get("train_micro_batch_size_per_gpu"), saved.get("gradient_accumulation_steps", 1)
        now = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] * self.world
        if (micro, gas * then) != now:
            self.log(f"the checkpoint had {gas * then} data slot(s) of micro-batch {micro}, this run has {now[1]} of "
                     f"{now[0]}: every slot's random streams start afresh from (train.seed, slot, step)")
            return None
        out = {}
        for v in slots:
            held = states[v % then]
            # (a file from before slots: the rank's one stream, its first micro-step's)
            by_slot = held.get("slots") or {v % then: {k: held[k] for k in ("generator", "torch_rng", "cuda_rng")
                                                       if k in held}}
            if v in by_slot:
                out[v] = by_slot[v]
        return out

    # ---- what a resume changed ------------------------------------------------------------------------------
    def apply_config_rates(self, engine, emas: dict, cfg) -> None:
        """A checkpoint brings back the optimizer's hyper-parameters, the schedule's base rate and the EMA rates
        with their state; a resume whose config changed them trained on with the old ones, while config.json
        and the pipeline recorded the new. The config wins (lowering the rate on resume is a common fix), and
        the log says what changed. ``emas``: {"teacher": EMA, "sampling": EMA}."""
        o, changed = cfg.optimizer, {}
        sched = engine.lr_scheduler
        for i, group in enumerate(engine.optimizer.param_groups):
            for key, value in (("betas", tuple(o.betas)), ("weight_decay", o.weight_decay), ("eps", o.eps)):
                current = tuple(group[key]) if key == "betas" else group[key]
                if current != value:
                    changed[f"optimizer.{key}"] = (current, value)
                    group[key] = value
            if sched.base_lrs[i] != o.lr:
                changed["optimizer.lr"] = (sched.base_lrs[i], o.lr)
                sched.base_lrs[i] = o.lr
            group["lr"] = o.lr * sched.lr_lambdas[i](sched.last_epoch)  # the rate of the next step
        for name, ema in emas.items():
            if ema.decay != getattr(cfg.ema, name):
                changed[f"ema.{name}"] = (ema.decay, getattr(cfg.ema, name))
                ema.decay = getattr(cfg.ema, name)
        if changed:
            self.log("resuming with the config's " + ", ".join(f"{k} {new} (checkpoint: {old})"
                                                               for k, (old, new) in changed.items()))

    def record_resume(self, folder: Path, resolved_config: dict, step: int, steps: int) -> tuple[dict, list]:
        """(the checkpoint's own config, the resumes that changed settings, oldest first): what the checkpoint's
        run had that this run changed (the rates, the step count, ...: what the resume checks let through)
        gains an entry, kept with the next checkpoints and the pipeline."""
        try:
            saved = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):  # checkpoints from before configs were saved with them
            return resolved_config, []
        resumes = list(saved.pop("resumes", []))
        saved.pop("data", None)
        now = json.loads(json.dumps(resolved_config))
        changed = {k[len("config."):]: list(v) for k, v in _differences(saved, now, "config").items()
                   if k != "config.vqlcmd.train.resume"}
        if changed and step < steps:  # (with nothing to train, nothing changed)
            resumes.append({"step": step, "changed": changed})
            self.log(f"resuming at step {step} with settings other than the checkpoint's (recorded with the "
                     "next checkpoints and the pipeline): " + ", ".join(
                         f"{k} {json.dumps(new)} (was {json.dumps(old)})" for k, (old, new) in changed.items()))
        return saved, resumes
