#!/usr/bin/env python
"""Train VQ-LCMD.

    deepspeed scripts/train.py --config ds_imagenet.json      # any number of ranks / nodes
    python scripts/train.py --config ds_digits.json           # one process (or: vqlcmd-train --config ...)

``--config`` takes a path or the name of a shipped config (configs/). One file holds
DeepSpeed's keys and a ``vqlcmd`` section (see configs/README.md). Relative paths
in it are relative to the working directory.
"""
from __future__ import annotations

import os
import sys

# OpenMP reads its wait policy once, as torch loads it: set before anything imports torch, so that waiting
# threads sleep instead of spinning against other work on the cores (see vqlcmd/threads.py)
if os.environ.get("VQLCMD_THREADS", "").strip().lower() != "torch":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import errno
import json
import signal

from vqlcmd.engine.config import ConfigError  # noqa: E402
from vqlcmd.engine.config_file import load_config  # noqa: E402
from vqlcmd.engine.ds_config import is_deepspeed_key, near_deepspeed_key  # noqa: E402
from vqlcmd.cli import add_threads_option  # noqa: E402


def _rank0_print(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # (the trainer's log lines are rank 0's too)
        print(line)


def _set(section: dict, dotted: str, value: str) -> None:
    *path, last = dotted.split(".")
    for i, key in enumerate(path):
        section = section.setdefault(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(path[:i + 1])} is not a section")
    try:
        section[last] = json.loads(value)
    except json.JSONDecodeError:
        section[last] = value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="config file: a path or the name of a shipped config (configs/; required to train)")
    parser.add_argument("--verify-checkpoints", metavar="DIR",
                        help="check every checkpoint in DIR (a run's output_dir or its checkpoints/ folder; one "
                             "checkpoint or an exported pipeline folder also works) against its manifest, without "
                             "training: one line each; exit status 1 when the one a resume takes first fails")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a vqlcmd key, e.g. --set train.steps=200 --set loss.beta_cm=0, or a "
                             "DeepSpeed one: --set train_batch_size=16 --set zero_optimization.stage=1")
    parser.add_argument("--evaluate", action="store_true",
                        help="after training, sample a class-conditional grid and (digits) report accuracy")
    parser.add_argument("--fast", action="store_true",
                        help="the throughput step: --set train.fast=true --set train.compile=true (the whole loss "
                             "compiled; no host reads inside a step, losses checked at log steps and before every "
                             "save; see docs/fast_training.md)")
    parser.add_argument("--no-progress", action="store_true")
    add_threads_option(parser)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    if args.verify_checkpoints:  # before any config is read: a damaged run must be checkable as it is
        from vqlcmd.engine.checkpoint import verify_checkpoints_cli

        return verify_checkpoints_cli(args.verify_checkpoints)
    if not args.config:
        parser.error("--config is required (or --verify-checkpoints DIR)")
    if args.fast:  # first: a --set of either key after it still decides
        args.set[:0] = ["train.fast=true", "train.compile=true"]

    def apply_sets(deepspeed: bool):
        def apply(section: dict) -> None:
            for item in args.set:
                key, eq, value = item.partition("=")
                if not eq or not key:
                    raise ConfigError(f"--set takes KEY=VALUE (a JSON value), got {item!r}")
                if is_deepspeed_key(key) != deepspeed:
                    continue
                if not deepspeed:
                    near_deepspeed_key(key)  # a misspelt DeepSpeed key: said so, not "unknown key vqlcmd..."
                _set(section, key, value)
        return apply

    try:
        # on the file's section, before parsing forces the method's switches: a --set method=... after it kept
        # the file's method's switches under the new name
        ds_config, cfg = load_config(args.config, edit=apply_sets(False), edit_deepspeed=apply_sets(True))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from vqlcmd.engine.parent_watch import watch_launcher
    from vqlcmd.threads import configure

    # under the deepspeed launcher: this rank stops (SIGTERM: save, then exit) when a launcher above it dies,
    # even by SIGKILL, instead of training on as an orphan beside a relaunched run
    watch_launcher()
    configure(args.threads, log=_rank0_print)  # before the digits' tokenizer or the model computes anything

    from vqlcmd.data.shards import ShardError
    from vqlcmd.engine.checkpoint import CheckpointError
    from vqlcmd.engine.distributed import LaunchError, RankSetupError
    from vqlcmd.engine.trainer import NonFiniteLossError, Trainer, TrainingInterrupted

    trainer = None
    try:
        trainer = Trainer(ds_config, cfg, progress=not args.no_progress)
        if args.evaluate and trainer.tokenizer_dir is None:  # found before training, not after it
            raise ConfigError("--evaluate saves a decoded sample grid and needs data.tokenizer (the VQ tokenizer's "
                              "folder, as given to vqlcmd-tokenize); set it, or drop --evaluate")
        trainer.train(progress=not args.no_progress)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (RankSetupError, LaunchError) as exc:  # another rank's error (printed by it), ranks on different data,
        # or processes that form no group
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return 2
    except ShardError as exc:  # a corrupt or inconsistent token shard
        print(f"data error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # an empty shard folder, a tokenizer folder without its files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # a full disk mid-save: the folder and what survived, in a line (the save never published the folder)
        kept = trainer.checkpoints.last_checkpoint_words() if trainer is not None else "nothing was saved"
        print(f"error: {exc.strerror} writing {exc.filename or 'a file'}; {kept}; free space and launch the same "
              "command again to resume", file=sys.stderr)
        return 1
    except NonFiniteLossError as exc:  # named by step and term: the traceback adds nothing
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TrainingInterrupted as exc:  # Ctrl-C or a preemption, after a checkpoint: the shell's code for it
        print(str(exc), file=sys.stderr)
        return 128 + (exc.signum or signal.SIGTERM)
    if args.evaluate and trainer.rank == 0:
        from vqlcmd.engine.report import final_report

        final_report(trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
