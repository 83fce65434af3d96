"""Property-based: random allocate / append / compute / fork / free / evict programs.

Every token's "KV" is a deterministic function of the whole prefix up to it (as real KV is), so
a gathered value that came from the wrong block, a stale block, a sibling's divergent tokens or
a missed copy-on-write shows up as a mismatch.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from patrl.kvstore import BlockManager, KVCacheSpec, PagedKVCache, chained_hash

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def colliding_hash(prev: int, tokens: tuple[int, ...]) -> int:
    """A deliberately terrible hash: most different prefixes collide."""
    return (prev + sum(tokens)) % 3


def true_kv(prefix: list[int]) -> float:
    """What the model would write for the last token of `prefix`: exact in float64."""
    return float(hash(tuple(prefix)) % (1 << 40))


class KVStoreMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(4, 16),
        prefix=st.booleans(),
        collide=st.booleans(),
    )
    def setup(self, block_size: int, num_blocks: int, prefix: bool, collide: bool) -> None:
        spec = KVCacheSpec(
            num_layers=2, num_kv_heads=1, head_dim=1, block_size=block_size, dtype=torch.float64
        )
        self.cache = PagedKVCache(spec, num_blocks, enable_prefix_caching=prefix)
        # Hash collisions must cost cache hits, never correctness.
        hash_fn = colliding_hash if collide else chained_hash
        self.cache.blocks = BlockManager(num_blocks, block_size, prefix, hash_fn=hash_fn)
        self.bm = self.cache.blocks
        self.seqs: list[int] = []
        self.next_id = 0

    def _compute(self, seq: int, count: int) -> None:
        tokens = self.bm.token_ids(seq)
        start = self.bm.num_computed(seq)
        end = min(len(tokens), start + count)
        slots = torch.tensor(self.bm.slot_mapping(seq, start, end), dtype=torch.long)
        values = torch.tensor(
            [true_kv(tokens[: i + 1]) for i in range(start, end)], dtype=torch.float64
        )
        for layer in range(2):
            kv = values.view(-1, 1, 1) + layer
            self.cache.write(layer, slots, kv, -kv)
        self.bm.mark_computed(seq, end - start)

    @rule(tokens=TOKENS, chunk=st.integers(1, 14))
    def allocate(self, tokens: list[int], chunk: int) -> None:
        if not self.bm.can_allocate(tokens):
            return
        seq = self.next_id
        self.next_id += 1
        cached = self.bm.allocate(seq, tokens)
        assert 0 <= cached < len(tokens), "the last token must always be computed"
        assert cached % self.bm.block_size == 0
        self.seqs.append(seq)
        self._compute(seq, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 14))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self._compute(seq, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if not self.bm.can_append(seq, len(tokens)):
            return
        self.cache.copy_blocks(self.bm.append(seq, tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if self.bm.num_uncomputed(seq):
            self._compute(seq, self.bm.num_uncomputed(seq))
        children = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.bm.fork(seq, children)
        self.seqs.extend(children)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        before = (self.bm.num_cached_free_blocks, self.bm.num_free_blocks)
        evicted = self.bm.evict(n)
        assert evicted == min(n, before[0])
        # Eviction only forgets prefixes; the number of blocks that can be handed out is the same.
        assert self.bm.num_free_blocks == before[1]

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_integrity()

    @invariant()
    def gathered_kv_is_what_was_written(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs:
            tokens = self.bm.token_ids(seq)
            n = self.bm.num_computed(seq)
            expected = torch.tensor(
                [true_kv(tokens[: i + 1]) for i in range(n)], dtype=torch.float64
            )
            for layer in range(2):
                ks, vs = self.cache.gather(layer, [self.bm.block_table(seq)], [n])
                assert torch.equal(ks[0].flatten(), expected + layer), f"seq {seq} layer {layer}"
                assert torch.equal(vs[0].flatten(), -(expected + layer))


KVStoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStore = KVStoreMachine.TestCase
