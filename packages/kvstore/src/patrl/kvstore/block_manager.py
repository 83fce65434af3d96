"""Which KV blocks hold which tokens: allocation, reference counts, prefix cache, fork.

Token `i` of a sequence is in block `table[i // block_size]` at offset `i % block_size`. A full,
written block is registered under a chained hash of its tokens and its parent's hash; a hit
needs equal tokens and the exact parent block (id and epoch), so a collision never hands out
wrong KV. A registered block whose last reference is freed stays findable until evicted,
least recently freed first. Invariants (`check_integrity`): free + cached-free + in-use ==
num_blocks; a block's ref_count equals the table entries pointing at it; every token still to
be computed sits in a block its sequence owns alone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

HashFn = Callable[[int, tuple[int, ...]], int]

_ROOT_HASH = 0
# The "parent" of a sequence's first block: no real block has id -1.
_ROOT_PARENT = (-1, 0)


def chained_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (Python's tuple hash: stable
    across processes for ints, so replicas agree)."""
    return hash((prev_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Bumped every time the block is handed out fresh, so a child's record of its parent goes
    # stale when the parent's storage is reused for something else.
    epoch: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: tuple[int, int] = _ROOT_PARENT


@dataclass(slots=True)
class _SeqBlocks:
    block_table: list[int]
    token_ids: list[int]
    num_computed: int
    # Chained content hash of each leading full block whose KV is computed.
    block_hashes: list[int] = field(default_factory=list)
    # Prefix-cache generation the sequence's KV belongs to (see `reset_prefix_cache`).
    generation: int = 0


class BlockManager:
    """Paged-KV bookkeeping for one cache. Pure Python: no tensors, no device."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = chained_hash,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash = hash_fn
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Registered blocks with no reference, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._index: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self._generation = 0

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including cached-free ones, by eviction)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._get(seq_id).block_table

    def token_ids(self, seq_id: Hashable) -> list[int]:
        return self._get(seq_id).token_ids

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).token_ids)

    def num_computed(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_computed

    def num_uncomputed(self, seq_id: Hashable) -> int:
        """Tokens with a slot but no KV yet: what the next forward must process."""
        seq = self._get(seq_id)
        return len(seq.token_ids) - seq.num_computed

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slots of tokens `[start, end)` of a sequence."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= len(seq.token_ids):
            raise IndexError(
                f"tokens [{start}, {end}) of sequence {seq_id!r} are outside its allocation "
                f"of {len(seq.token_ids)} tokens"
            )
        bs, table = self.block_size, seq.block_table
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def ref_count(self, block_id: int) -> int:
        """How many block-table entries point at block `block_id`."""
        return self._blocks[block_id].ref_count

    def prefix_hit_rate(self) -> float:
        if self.prefix_queries_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queries_tokens

    # --------------------------------------------------------------- allocation

    def num_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of the first tokens `allocate` would find computed in the prefix cache."""
        return len(self._match_prefix(token_ids)) * self.block_size

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether `allocate` would succeed now (counting prefix-cache hits)."""
        hits = self._match_prefix(token_ids)
        # A hit on a cached-free block also takes it out of the free pool.
        taken = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        new = self._blocks_for(len(token_ids)) - len(hits)
        return taken + new <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Give a new sequence slots for all its tokens; return how many are already computed.

        The returned count comes from prefix-cache hits and is always below `len(token_ids)`:
        the last token is computed anyway, because its logits are needed to sample the next one.
        Callers must use this return value (not a count computed before the call) as the start
        of the prefill.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r} has no tokens; at least one is required")
        if not self.can_allocate(token_ids):
            raise RuntimeError(
                f"not enough free KV blocks for sequence {seq_id!r} ({len(token_ids)} tokens, "
                f"{self.num_free_blocks} blocks free); check can_allocate first"
            )
        hits = self._match_prefix(token_ids)
        table: list[int] = []
        for b in hits:
            self._take(b)
            table.append(b)
        for _ in range(self._blocks_for(len(token_ids)) - len(hits)):
            table.append(self._take_fresh())
        num_cached = len(hits) * self.block_size
        hashes = [h for b in hits if (h := self._blocks[b].hash) is not None]
        self._seqs[seq_id] = _SeqBlocks(
            table, list(token_ids), num_cached, hashes, self._generation
        )
        self.prefix_queries_tokens += len(token_ids)
        self.prefix_hit_tokens += num_cached
        return num_cached

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return self._blocks_needed_to_append(self._get(seq_id), num_tokens) <= self.num_free_blocks

    def append(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Give slots to new tokens of a sequence (their KV is not computed yet).

        Returns copy-on-write moves `(src_block, dst_block)` that the cache must perform before
        writing: when the sequence's partial last block is shared with a fork sibling, this
        sequence gets its own copy of it.
        """
        seq = self._get(seq_id)
        if not token_ids:
            return []
        needed = self._blocks_needed_to_append(seq, len(token_ids))
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"not enough free KV blocks to append {len(token_ids)} tokens to sequence "
                f"{seq_id!r} ({needed} needed, {self.num_free_blocks} free); check can_append first"
            )
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        if len(seq.token_ids) % bs != 0:
            last = seq.block_table[-1]
            if self._blocks[last].ref_count > 1:
                fresh = self._take_fresh()
                self._blocks[last].ref_count -= 1
                seq.block_table[-1] = fresh
                copies.append((last, fresh))
        seq.token_ids.extend(token_ids)
        while len(seq.block_table) * bs < len(seq.token_ids):
            seq.block_table.append(self._take_fresh())
        return copies

    def num_blocks_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks `append` of `num_tokens` tokens would take now (a copy-on-write
        included)."""
        return self._blocks_needed_to_append(self._get(seq_id), num_tokens)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Drop a sequence's last `num_tokens` tokens and their slots (rejected speculative
        tokens), computed or not; at least one token stays.

        Blocks past the new end lose this sequence's reference: freed with their last one, a
        registered one kept findable (its KV is that of its own tokens). The block the new end
        falls inside keeps this sequence's reference: when the sequence owns it alone it is
        unregistered and its epoch bumped (its tail will be overwritten, so no child record may
        match it); when it is shared it is left unchanged, and the next `append` copies it.
        A block another sequence uses is never changed or freed.
        """
        seq = self._get(seq_id)
        n = len(seq.token_ids)
        if not 0 <= num_tokens < n:
            raise ValueError(
                f"cannot truncate {num_tokens} of the {n} tokens of sequence {seq_id!r}: "
                f"accepted is 0 to {n - 1} (a sequence keeps at least one token)"
            )
        if num_tokens == 0:
            return
        end = n - num_tokens
        del seq.token_ids[end:]
        seq.num_computed = min(seq.num_computed, end)
        keep = self._blocks_for(end)
        for b in reversed(seq.block_table[keep:]):
            self._release(b)
        del seq.block_table[keep:]
        del seq.block_hashes[seq.num_computed // self.block_size :]
        if end % self.block_size:
            last = self._blocks[seq.block_table[-1]]
            if last.ref_count == 1:
                self._unregister(last.block_id)
                last.epoch += 1

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the KV of the next `num_tokens` uncomputed tokens has been written.

        Full blocks become findable by the prefix cache only now, after their KV exists.
        """
        seq = self._get(seq_id)
        if num_tokens < 0 or seq.num_computed + num_tokens > len(seq.token_ids):
            raise ValueError(
                f"cannot mark {num_tokens} tokens computed for sequence {seq_id!r}: "
                f"{len(seq.token_ids) - seq.num_computed} are uncomputed"
            )
        seq.num_computed += num_tokens
        self._register_full_blocks(seq)

    def fork(self, seq_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Make each child share the parent's blocks (the n samples of one prompt).

        All of the parent's tokens must be computed: children share KV, not pending work.
        A shared partial last block is copied on a child's first append (see `append`).
        """
        parent = self._get(seq_id)
        if parent.num_computed != len(parent.token_ids):
            raise ValueError(
                f"cannot fork sequence {seq_id!r}: {len(parent.token_ids) - parent.num_computed} "
                "of its tokens are not computed yet"
            )
        for child in child_ids:
            if child in self._seqs:
                raise ValueError(f"fork target {child!r} is already allocated")
        for child in child_ids:
            for b in parent.block_table:
                self._blocks[b].ref_count += 1
            self._seqs[child] = _SeqBlocks(
                list(parent.block_table),
                list(parent.token_ids),
                parent.num_computed,
                list(parent.block_hashes),
                parent.generation,
            )

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks. Registered blocks stay findable until evicted."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(
                f"sequence {seq_id!r} is not allocated (freed twice, or never allocated)"
            )
        # Tail first, so LRU eviction drops the ends of chains before their shared prefixes.
        for b in reversed(seq.block_table):
            self._release(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, e.g. after new weights made the stored KV stale.

        Running sequences keep their blocks, but nothing they computed before or compute
        after this call is registered again: their KV mixes the old weights in.
        """
        self._generation += 1
        for b in list(self._index.values()):
            self._unregister(b)
        while self._cached_free:
            b, _ = self._cached_free.popitem(last=False)
            self._free.append(b)

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` cached-free blocks from the prefix cache (LRU first)."""
        evicted = 0
        while evicted < num_blocks and self._cached_free:
            b, _ = self._cached_free.popitem(last=False)
            self._unregister(b)
            self._free.append(b)
            evicted += 1
        return evicted

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError with a description if any invariant is broken."""
        free, cached = set(self._free), set(self._cached_free)
        used = {b.block_id for b in self._blocks if b.ref_count > 0}
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        if free & cached or free & used or cached & used:
            raise AssertionError(
                f"a block is in two pools: free&cached={free & cached}, "
                f"free&used={free & used}, cached&used={cached & used}"
            )
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + cached-free {len(cached)} + used {len(used)} "
                f"!= total {self.num_blocks}"
            )
        refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            if len(seq.block_table) != self._blocks_for(len(seq.token_ids)):
                raise AssertionError(
                    f"sequence {seq_id!r} has {len(seq.block_table)} blocks for "
                    f"{len(seq.token_ids)} tokens"
                )
            for b in seq.block_table:
                refs[b] += 1
            first_pending = seq.num_computed // self.block_size
            for b in seq.block_table[first_pending:]:
                if seq.num_computed < len(seq.token_ids) and self._blocks[b].ref_count != 1:
                    raise AssertionError(
                        f"sequence {seq_id!r} would write into shared block {b} "
                        f"(ref_count {self._blocks[b].ref_count})"
                    )
        for block in self._blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_count {block.ref_count} but "
                    f"{refs[block.block_id]} table references"
                )
            if block.block_id in cached and block.hash is None:
                raise AssertionError(f"cached-free block {block.block_id} is not registered")
        for h, b in self._index.items():
            if self._blocks[b].hash != h:
                raise AssertionError(
                    f"prefix index entry {h} points at block {b} with another hash"
                )

    # ---------------------------------------------------------------- internals

    def _get(self, seq_id: Hashable) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not allocated")
        return seq

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_needed_to_append(self, seq: _SeqBlocks, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        n = len(seq.token_ids)
        new = self._blocks_for(n + num_tokens) - len(seq.block_table)
        shared_partial = (
            n % self.block_size != 0 and self._blocks[seq.block_table[-1]].ref_count > 1
        )
        return new + int(shared_partial)

    def _match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, never covering the last token."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        h, parent = _ROOT_HASH, _ROOT_PARENT
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._hash(h, tokens)
            b = self._index.get(h)
            if b is None:
                break
            block = self._blocks[b]
            if block.token_ids != tokens or block.parent != parent:
                break  # a hash collision, or the same tokens after another prefix
            hits.append(b)
            parent = (b, block.epoch)
        return hits

    def _release(self, b: int) -> None:
        """Drop one reference to block `b`; with the last, it goes to a free pool."""
        block = self._blocks[b]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._cached_free[b] = None
            else:
                self._free.append(b)

    def _take(self, b: int) -> None:
        block = self._blocks[b]
        if block.ref_count == 0:
            del self._cached_free[b]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if self._free:
            b = self._free.popleft()
        elif self._cached_free:
            b, _ = self._cached_free.popitem(last=False)
            self._unregister(b)
        else:
            raise RuntimeError("no free KV block (callers must check can_allocate/can_append)")
        block = self._blocks[b]
        block.ref_count = 1
        block.epoch += 1
        return b

    def _unregister(self, b: int) -> None:
        block = self._blocks[b]
        if block.hash is not None and self._index.get(block.hash) == b:
            del self._index[block.hash]
        block.hash, block.token_ids, block.parent = None, (), _ROOT_PARENT

    def _register_full_blocks(self, seq: _SeqBlocks) -> None:
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            prev = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
            h = self._hash(prev, tokens)
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching or seq.generation != self._generation:
                continue
            b = seq.block_table[i]
            block = self._blocks[b]
            if block.hash is not None:
                continue  # reached through a prefix hit or a fork: already registered
            parent = _ROOT_PARENT
            if i > 0:
                pb = seq.block_table[i - 1]
                parent = (pb, self._blocks[pb].epoch)
            twin = self._index.get(h)
            if twin is not None:
                other = self._blocks[twin]
                if other.token_ids == tokens and other.parent == parent and block.ref_count == 1:
                    # Another sequence computed the same prefix in the same step: share its
                    # block and give this duplicate back, so a prefix is held once.
                    self._take(twin)
                    seq.block_table[i] = twin
                    block.ref_count = 0
                    self._free.append(b)
                # Otherwise a hash collision, or a block shared by forks: keep the indexed
                # block; this one stays private and is freed normally.
                continue
            block.hash, block.token_ids, block.parent = h, tokens, parent
            self._index[h] = b
