"""The registry of training methods: what a method declares (``Method``), and lookup by name."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..network import VQLCMDNetwork


@dataclass(frozen=True)
class Method:
    name: str
    # (section, key) -> value, forced over the config file's, so the resolved config shows what trained
    switches: dict = field(default_factory=dict)
    # losses(net, teacher_fn, schedule, tokens, labels, cfg, generator, backend) -> {"loss": ..., terms}
    losses: Callable = None
    # draw(net, tokens, labels, cfg, generator, backend) -> the loss's random numbers, drawn first, and
    # losses_drawn(net, teacher_fn, schedule, tokens, labels, cfg, draws, backend) -> losses' result with them:
    # a loss that draws nothing compiles to one graph (the flat step's); without them the losses draw inside
    draw: Optional[Callable] = None
    losses_drawn: Optional[Callable] = None
    # the pipeline class that samples what this method trains (a VQLCMDPipeline subclass)
    pipeline_class: type = None
    # pipeline_kwargs(cfg) -> extra constructor arguments and sample defaults of the exported pipeline
    pipeline_kwargs: Callable = None
    # the config sections a resume must match exactly, besides method/model/embedding/schedule
    resume_sections: tuple = ()
    # the sections of the objective a resume compares: {section: None (all keys) or (keys, ...)}
    objective: dict = field(default_factory=lambda: {"loss": None})
    # build_network(cfg, den_cfg, tokenizer_dir, log) -> VQLCMDNetwork
    build_network: Optional[Callable] = None
    # the vqlcmd.ops its loss calls with the run's train.backend, which must therefore serve each of them
    ops: tuple = ()
    # the sampling steps of the preview grids: the run's sample section, or the method's own default (None)
    grid_steps: Callable = lambda cfg: cfg.sample.grid_steps or cfg.sample.num_steps

    def apply(self, cfg):
        """``cfg`` (a ``VQLCMDConfig``) with this method's switches forced; a new config."""
        sections: dict = {}
        for (section, key), value in self.switches.items():
            sections.setdefault(section, {})[key] = value
        return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kv)
                                           for name, kv in sections.items()})

    def network(self, cfg, den_cfg, tokenizer_dir=None, log=print) -> VQLCMDNetwork:
        if self.build_network is not None:
            return self.build_network(cfg, den_cfg, tokenizer_dir, log)
        return VQLCMDNetwork(den_cfg, frozen_embeddings=cfg.embedding.frozen,
                             l2_normalize=cfg.embedding.l2_normalize)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _REGISTRY:
        raise ValueError(f"method {method.name!r} is registered twice")
    _REGISTRY[method.name] = method
    from ..pipeline import register_pipeline_class

    register_pipeline_class(method.name, method.pipeline_class)
    return method


def method_names() -> tuple:
    return tuple(_REGISTRY)


def get_method(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(_REGISTRY)}, got {name!r}") from None


def apply_method(cfg):
    """The config with its method's defining switches forced (a ``VQLCMDConfig``; returns a new one)."""
    return get_method(cfg.method).apply(cfg)


def build_network(cfg, den_cfg, tokenizer_dir=None, log=print) -> VQLCMDNetwork:
    """The trained network of ``cfg.method`` (CSDM† takes the tokenizer's codebook as its frozen table)."""
    return get_method(cfg.method).network(cfg, den_cfg, tokenizer_dir, log)
