"""patrl.tpreshard: parallel layouts as data, and how parameters are cut across TP ranks."""

from patrl.tpreshard.comm import (
    broadcast_obj,
    gather_objects,
    tp_all_gather,
    tp_all_gather_into,
    tp_all_reduce,
    tp_broadcast,
)
from patrl.tpreshard.groups import GroupCache
from patrl.tpreshard.kv_reshard import (
    KVReshardStats,
    KVShape,
    SequenceMove,
    heads_sent,
    reshard_kv,
)
from patrl.tpreshard.layout import ParallelLayout, single_process_layout
from patrl.tpreshard.nodes import NodeMap, gather_node_map, node_rank_from_env, tp_group_ranks
from patrl.tpreshard.reshard import (
    ReshardStats,
    forget_full,
    has_full,
    index_map,
    kept_tensors,
    reshard_,
    restore_full_,
)
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
from patrl.tpreshard.shm import CollectiveTimeout, ShmComm, shm_supported

__all__ = [
    "CollectiveTimeout",
    "GroupCache",
    "KVReshardStats",
    "KVShape",
    "NodeMap",
    "ParallelLayout",
    "ReshardStats",
    "SequenceMove",
    "ShardKind",
    "ShardPart",
    "ShardSpec",
    "ShmComm",
    "broadcast_obj",
    "forget_full",
    "gather_node_map",
    "gather_objects",
    "has_full",
    "head_range",
    "heads_sent",
    "index_map",
    "kept_tensors",
    "load_full",
    "node_rank_from_env",
    "reshard_",
    "reshard_kv",
    "restore_full_",
    "shard_part",
    "shard_tensor",
    "shm_supported",
    "single_process_layout",
    "tp_all_gather",
    "tp_all_gather_into",
    "tp_all_reduce",
    "tp_broadcast",
    "tp_group_ranks",
    "vocab_range",
]
