"""Converts a taming-transformers VQGAN checkpoint (``.ckpt``, weights under ``state_dict``) into a
diffusers ``VQModel`` folder that ``load_tokenizer`` reads.

The two implementations compute the same function; only names (and the attention projections,
1x1 convs in taming, linear layers in diffusers) differ. Every checkpoint tensor is either mapped
or deliberately dropped (``loss.*``: the discriminator and LPIPS used only for training the VQGAN);
anything else is an error, so a checkpoint with an unexpected layout fails loudly instead of
loading half its weights.

The released checkpoints are PyTorch Lightning training checkpoints (optimizer states, callbacks keyed
by Lightning classes): ``load_taming_state_dict`` reads those without Lightning and without running code
from the file (see ``inert_load``), and keeps only ``state_dict``.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

from .inert_load import RefusedGlobal, inert_torch_load

# The paper's tokenizer, vqgan_imagenet_f16_1024 (its model.params / ddconfig).
IMAGENET_F16_1024 = dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=2, attn_resolutions=[16], z_channels=256,
                         embed_dim=256, n_embed=1024, resolution=256, in_channels=3, out_ch=3)
DROPPED_PREFIXES = ("loss.",)


def read_taming_config(config) -> dict:
    """A dict of ddconfig keys (+ embed_dim, n_embed), or a taming ``.yaml`` (model.params)."""
    if config is None:
        return dict(IMAGENET_F16_1024)
    if isinstance(config, (str, os.PathLike)):
        import yaml  # only needed for yaml configs

        params = yaml.safe_load(Path(config).read_text())["model"]["params"]
        config = dict(params["ddconfig"], embed_dim=params["embed_dim"], n_embed=params["n_embed"])
    unknown = sorted(set(config) - set(IMAGENET_F16_1024) - {"double_z", "dropout"})  # ("dropout": unused here)
    if unknown:  # a misspelt key would leave the ImageNet f16 default in its place, silently
        raise ValueError(f"taming config: unknown key(s) {unknown} (known: {sorted(IMAGENET_F16_1024)}, double_z, "
                         "dropout)")
    cfg = dict(IMAGENET_F16_1024)  # keys not given: the ImageNet f16 VQGAN's
    cfg.update(config)
    if cfg.get("double_z"):
        raise ValueError("taming config has double_z=True: that is a KL autoencoder, not a VQGAN")
    return cfg


def vqmodel_from_taming_config(config=None, device=None):
    from diffusers import VQModel

    c = read_taming_config(config)
    n = len(c["ch_mult"])
    attn = [c["resolution"] // 2 ** i in c["attn_resolutions"] for i in range(n)]
    down = tuple("AttnDownEncoderBlock2D" if a else "DownEncoderBlock2D" for a in attn)
    up = tuple("AttnUpDecoderBlock2D" if a else "UpDecoderBlock2D" for a in reversed(attn))
    with torch.device(device or "cpu"):
        return VQModel(in_channels=c["in_channels"], out_channels=c["out_ch"], down_block_types=down,
                       up_block_types=up, block_out_channels=tuple(c["ch"] * m for m in c["ch_mult"]),
                       layers_per_block=c["num_res_blocks"], latent_channels=c["z_channels"],
                       num_vq_embeddings=c["n_embed"], vq_embed_dim=c["embed_dim"], norm_num_groups=32,
                       sample_size=c["resolution"])


_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _map_key(key: str, levels: int) -> str | None:
    """taming name -> diffusers name (None: not a model tensor we know)."""
    m = re.fullmatch(r"(encoder|decoder)\.(.+)", key)
    if not m:
        return key if key in ("quant_conv.weight", "quant_conv.bias", "post_quant_conv.weight",
                              "post_quant_conv.bias", "quantize.embedding.weight") else None
    part, rest = m.groups()
    simple = {"conv_in": "conv_in", "conv_out": "conv_out", "norm_out": "conv_norm_out"}
    m = re.fullmatch(r"(conv_in|conv_out|norm_out)\.(weight|bias)", rest)
    if m:
        return f"{part}.{simple[m[1]]}.{m[2]}"
    m = re.fullmatch(r"mid\.(block_1|block_2)\.(\w+)\.(weight|bias)", rest)
    if m and m[2] in _RESNET:
        return f"{part}.mid_block.resnets.{int(m[1][-1]) - 1}.{_RESNET[m[2]]}.{m[3]}"
    m = re.fullmatch(r"mid\.attn_1\.(\w+)\.(weight|bias)", rest)
    if m and m[1] in _ATTN:
        return f"{part}.mid_block.attentions.0.{_ATTN[m[1]]}.{m[2]}"
    # decoder.up is stored lowest resolution last (taming inserts at 0); diffusers runs up_blocks in order
    m = re.fullmatch(r"(down|up)\.(\d+)\.(block|attn)\.(\d+)\.(\w+)\.(weight|bias)", rest)
    if m:
        kind, i, sub, j, name, wb = m.groups()
        blocks = "down_blocks" if kind == "down" else "up_blocks"
        i = int(i) if kind == "down" else levels - 1 - int(i)
        table = _RESNET if sub == "block" else _ATTN
        if name in table:
            return f"{part}.{blocks}.{i}.{'resnets' if sub == 'block' else 'attentions'}.{j}.{table[name]}.{wb}"
        return None
    m = re.fullmatch(r"(down|up)\.(\d+)\.(downsample|upsample)\.conv\.(weight|bias)", rest)
    if m:
        kind, i, what, wb = m.groups()
        i = int(i) if kind == "down" else levels - 1 - int(i)
        return f"{part}.{'down_blocks' if kind == 'down' else 'up_blocks'}.{i}.{what}rs.0.conv.{wb}"
    return None


def taming_to_diffusers_state_dict(state: dict, levels: int) -> tuple[dict, list[str]]:
    """Renames (and reshapes) a taming VQGAN state dict; returns (diffusers state dict, dropped keys).
    Raises on any key it cannot place."""
    out, dropped, unknown = {}, [], []
    for k, v in state.items():
        if k.startswith(DROPPED_PREFIXES):
            dropped.append(k)
            continue
        new = _map_key(k, levels)
        if new is None:
            unknown.append(k)
            continue
        if ".attentions." in new and new.endswith(".weight") and "group_norm" not in new:
            if v.dim() != 4 or v.shape[2:] != (1, 1):
                raise ValueError(f"taming checkpoint tensor {k}: expected a 1x1 convolution (C, C, 1, 1), got shape "
                                 f"{tuple(v.shape)}")
            v = v.reshape(v.shape[0], v.shape[1])  # 1x1 conv (C, C, 1, 1) -> linear (C, C)
        out[new] = v
    if unknown:
        raise ValueError(f"taming checkpoint has {len(unknown)} tensor(s) the converter does not know: "
                         f"{unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    return out, dropped


def _plain(message: str) -> str:
    """The first line of a library's message, without terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", message).strip().splitlines()[0] if message.strip() else message


def load_taming_state_dict(path) -> dict:
    """The ``state_dict`` of a taming ``.ckpt``; everything else in the file (a Lightning training
    checkpoint's optimizer states, callbacks, hparams) is read as inert data and dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"taming checkpoint {str(path)!r} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch's zip format, or a legacy pickle
        raise ValueError(f"taming checkpoint {path} is not a torch checkpoint (starts with {head!r})")
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # a training checkpoint (Lightning: callbacks, hparams, ...): see inert_load
            ckpt = inert_torch_load(path)
    except RefusedGlobal as e:
        raise ValueError(f"taming checkpoint {path} refused: {e}. Nothing from the file was run; a VQGAN "
                         "checkpoint needs no such call, so this file is not one to trust.") from None
    except (EOFError, RuntimeError, pickle.UnpicklingError) as e:  # cut off, or not a torch file at all
        raise ValueError(f"taming checkpoint {path} is not a readable torch checkpoint (truncated or another "
                         f"format): {_plain(str(e))}") from None
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"taming checkpoint {path}: expected a dict of tensors under 'state_dict'")
    return state


def convert_taming_checkpoint(ckpt_path, out_dir, config=None) -> dict:
    """Writes a diffusers VQModel folder converted from ``ckpt_path``; ``config`` is the taming model's
    ddconfig (+ embed_dim, n_embed) as a dict or its ``.yaml``; default: vqgan_imagenet_f16_1024.
    Returns a report: the tokenizer id and the mapped / dropped tensor counts."""
    cfg = read_taming_config(config)
    state = load_taming_state_dict(ckpt_path)
    model = vqmodel_from_taming_config(cfg)
    mapped, dropped = taming_to_diffusers_state_dict(state, len(cfg["ch_mult"]))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise ValueError(f"taming checkpoint {ckpt_path} lacks {len(missing)} tensor(s) the configured model needs "
                         f"(config {cfg}): {missing[:10]}")
    unexpected = sorted(set(mapped) - set(expected))
    if unexpected:  # e.g. more res blocks, attention levels or resolutions than the config says
        raise ValueError(f"taming checkpoint {ckpt_path} has {len(unexpected)} tensor(s) the configured model lacks "
                         f"(config {cfg}): {unexpected[:10]}")
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
           for k, v in mapped.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(f"taming checkpoint {ckpt_path} does not match config {cfg}: {bad[:5]}")
    model.load_state_dict(mapped, strict=True)
    model.save_pretrained(str(out_dir))
    from .vqmodel import model_identifier

    return {"folder": str(out_dir), "tokenizer_id": model_identifier(model), "mapped": len(mapped),
            "dropped": len(dropped), "total": len(state)}
