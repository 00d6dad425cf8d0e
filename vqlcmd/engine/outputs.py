"""What a run shows while it trains: metrics (``metrics.jsonl`` and TensorBoard), the exported pipeline and
the sample grids. Rank 0 only; the trainer calls these, they know nothing of steps or checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..embedding import collapse_indicator
from ..methods import get_method
from ..pipeline import VQLCMDPipeline


class MetricsLog:
    """The log steps' scalars as JSON lines (readable without TensorBoard: the GPU check's throughput rows)
    and, where TensorBoard is installed, as event files."""

    def __init__(self, out_dir: Path, log):
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a bare GPU image: metrics.jsonl holds the same scalars
            log("tensorboard is not installed: no event files (the scalars go to metrics.jsonl)")
        else:
            self.tb = SummaryWriter(str(out_dir / "tb"))

    def scalars(self, step: int, terms: dict, lr: float, images_per_s: float, grad_norm, net, extra: dict) -> None:
        row = {**terms, "lr": lr, "images_per_s": images_per_s,
               "grad_norm": None if grad_norm is None else float(grad_norm), **extra}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        if self.tb is None:
            return
        for k, v in terms.items():
            self.tb.add_scalar(f"loss/{k}", v, step)
        if grad_norm is not None:
            self.tb.add_scalar("train/grad_norm", float(grad_norm), step)
        self.tb.add_scalar("train/lr", lr, step)
        self.tb.add_scalar("train/images_per_s", images_per_s, step)
        self.tb.add_scalar("train/tokens_per_s", images_per_s * net.config.seq_len, step)
        table = net.embedding.table()[:net.config.codebook_size].detach().float()
        self.tb.add_scalar("embedding/collapse_indicator", collapse_indicator(table), step)
        # L_DM and L_CM are sums over tokens of squared distances between embeddings, so they grow with the
        # table's scale: read their curves beside it (a growing norm is the shortcut dropping is meant to stop)
        self.tb.add_scalar("embedding/mean_row_norm", float(table.norm(dim=-1).mean()), step)
        self.tb.flush()


def build_pipeline(network, schedule, cfg, header: dict, tokenizer_dir, device, record: dict) -> VQLCMDPipeline:
    """``network`` (the sampling EMA) as its method's pipeline, tokenizer attached when known; ``record``: the
    training config, step and resumes kept in the pipeline's config."""
    tokenizer, ref = None, {"grid": list(header["grid"]), "identifier": header.get("tokenizer_id")}
    if tokenizer_dir is not None:
        from ..tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir).to(device)
        ref["path"] = str(Path(tokenizer_dir).resolve())
    method = get_method(cfg.method)
    return method.pipeline_class(network, schedule, tokenizer=tokenizer, tokenizer_ref=ref,
                                 class_names=header.get("class_names"), extra_config=record,
                                 **method.pipeline_kwargs(cfg))


def sample_grid(pipe, cfg, num_classes: int, path: Path, device, tb=None, step: int = 0) -> int:
    """A class-conditional grid (a row per class, ``report.grid_classes``) saved as PNG; returns the sampling
    steps it used: ``sample.grid_steps``, or the method's own count."""
    from torchvision.utils import save_image

    from .report import grid_classes

    s = cfg.sample
    C = num_classes
    g = torch.Generator(device=device).manual_seed(1234)
    steps = get_method(cfg.method).grid_steps(cfg)
    if C > 0:
        labels = grid_classes(C).repeat_interleave(s.per_class)
        images = pipe(labels, output_type="pt", generator=g, num_steps=steps)
    else:
        images = pipe(num_images=8 * s.per_class, output_type="pt", generator=g, num_steps=steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, str(path), nrow=s.per_class, padding=1)
    if tb is not None:
        from torchvision.utils import make_grid

        tb.add_image("samples", make_grid(images, nrow=s.per_class), step)
    return pipe.sample_defaults["num_steps"] if steps is None else steps


def untouched_rng(device):
    """Work outside training (loading the tokenizer initialises modules from the global generator) runs in a
    fork of the global RNG: attention dropout draws from it, and a run that wrote a checkpoint or a preview
    must go on exactly as a run resumed from that checkpoint, and as one that wrote neither."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
