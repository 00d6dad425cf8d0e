"""Data: image trees -> (DALI | PIL) -> tokenizer -> token shards -> rank-sharded loader.

Heavy dependencies (DALI, diffusers, scikit-learn) are imported where used, so that importing
``vqlcmd.data`` stays cheap.
"""
from .digits import CLASS_NAMES as DIGITS_CLASS_NAMES, default_cache_dir, digits_images, prepare_digits
from .decode import image_batches
from .images import ImageList, list_images
from .loader import ShardLoader
from .online import OnlineTokenLoader
from .shards import ShardError, TokenShardDataset, open_shard, write_shard
from .writer import write_token_shards

__all__ = ["DIGITS_CLASS_NAMES", "default_cache_dir", "digits_images", "prepare_digits", "ImageList",
           "image_batches", "list_images", "ShardLoader", "OnlineTokenLoader", "ShardError", "TokenShardDataset", "open_shard",
           "write_shard", "write_token_shards"]
