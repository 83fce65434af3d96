"""patrl.tpreshard: parallel layouts as data, and how parameters are cut across TP ranks."""

from patrl.tpreshard.groups import GroupCache
from patrl.tpreshard.layout import ParallelLayout, single_process_layout
from patrl.tpreshard.reshard import ReshardStats, index_map, reshard_
from patrl.tpreshard.shard import (
    ShardKind,
    ShardPart,
    ShardSpec,
    head_range,
    load_full,
    shard_part,
    shard_tensor,
    vocab_range,
)

__all__ = [
    "GroupCache",
    "ParallelLayout",
    "ReshardStats",
    "ShardKind",
    "ShardPart",
    "ShardSpec",
    "head_range",
    "index_map",
    "load_full",
    "reshard_",
    "shard_part",
    "shard_tensor",
    "single_process_layout",
    "vocab_range",
]
