"""VQ tokenizers: images in [-1, 1] <-> token grids.

- ``load_tokenizer(folder)``: a diffusers ``VQModel`` saved in a local folder (no network).
- ``convert_taming_checkpoint(ckpt, folder)``: a taming-transformers VQGAN ``.ckpt`` -> such a folder.
- ``small_vqmodel`` / ``train_vqmodel``: the small tokenizer the project trains itself (digits).
"""
from .base import Tokenizer
from .small import TrainConfig, evaluate, psnr, small_vqmodel, train_vqmodel
from .taming import convert_taming_checkpoint, taming_to_diffusers_state_dict, vqmodel_from_taming_config
from .vqmodel import VQModelTokenizer, load_tokenizer, load_vqmodel, model_identifier

__all__ = ["Tokenizer", "VQModelTokenizer", "load_tokenizer", "load_vqmodel", "model_identifier",
           "convert_taming_checkpoint", "taming_to_diffusers_state_dict", "vqmodel_from_taming_config",
           "small_vqmodel", "train_vqmodel", "TrainConfig", "evaluate", "psnr"]
