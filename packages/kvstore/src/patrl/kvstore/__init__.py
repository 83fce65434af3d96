"""patrl.kvstore: paged KV blocks, prefix sharing, fork, and export/import of sequences."""

from patrl.kvstore.block_manager import BlockManager, chained_hash
from patrl.kvstore.paged_cache import PagedKVCache
from patrl.kvstore.sequence_kv import SequenceKV
from patrl.kvstore.spec import KVCacheSpec

__all__ = ["BlockManager", "KVCacheSpec", "PagedKVCache", "SequenceKV", "chained_hash"]
