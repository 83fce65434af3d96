"""Finished samples kept for a continuation (a multi-turn conversation's next model turn).

A sample added with `keep=True` that finishes ("stop" or "length") is not freed: it stays here
with its KV blocks, which hold the KV of every token but its last sampled one (that token's
KV is only written when it is fed back). `Engine.continue_request` then appends the last
sampled token and the new tokens (a tool's answer) to those blocks and prefills exactly
those, so a conversation is never prefilled again. A kept sample holds no decode slot.

Under memory pressure the scheduler evicts kept samples, oldest first, before it preempts a
running one: their blocks are freed (full blocks stay findable by the prefix cache) and only
their tokens stay here, so a later continuation re-prefills by prefix caching, correctly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from patrl.kvstore import BlockManager
from patrl.rollout.sequence import Sequence

Key = tuple[str, int]  # (request id, sample index)


class KeptSequences:
    """Kept samples by (request id, sample index), oldest first; see the module docstring.
    Invariant: a kept sample's blocks, when it has any, hold exactly its tokens but the last
    sampled one, all computed."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[Key, Sequence] = OrderedDict()
        self.num_evicted = 0  # kept samples whose KV was freed under memory pressure

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._seqs))

    def keys(self) -> list[Key]:
        return list(self._seqs)

    def request_ids(self) -> list[str]:
        """Requests with a kept sample, each once, oldest first."""
        return list(dict.fromkeys(rid for rid, _ in self._seqs))

    def keep(self, seq: Sequence, blocks: BlockManager) -> None:
        """Keep finished `seq`: its slots past its last sampled token (rejected draft tokens)
        are dropped; blocks that do not hold exactly its written KV are freed instead (it
        then continues by prefix caching)."""
        sid = seq.seq_id
        if blocks.has(sid):
            extra = blocks.num_tokens(sid) - (seq.num_tokens - 1)
            if extra > 0:
                blocks.truncate(sid, extra)
            if (
                extra < 0
                or blocks.num_uncomputed(sid)
                or blocks.token_ids(sid) != seq.token_ids[:-1]
            ):
                blocks.free(sid)
        self._seqs[(seq.request_id, seq.sample_index)] = seq

    def get(self, key: Key) -> Sequence | None:
        """A kept sample, left kept."""
        return self._seqs.get(key)

    def take(self, key: Key) -> Sequence | None:
        """Remove and return a kept sample (its blocks, if any, now the caller's)."""
        return self._seqs.pop(key, None)

    def release(self, key: Key, blocks: BlockManager) -> None:
        """Forget a kept sample and free its blocks; KeyError when it is not kept."""
        seq = self._seqs.pop(key)
        if blocks.has(seq.seq_id):
            blocks.free(seq.seq_id)

    def release_all(self, blocks: BlockManager) -> None:
        for key in list(self._seqs):
            self.release(key, blocks)

    def drop_kv(self, blocks: BlockManager) -> None:
        """Free every kept sample's blocks, keeping its tokens (new weights, sleep, a new
        cache): their continuations re-prefill."""
        for seq in self._seqs.values():
            if blocks.has(seq.seq_id):
                blocks.free(seq.seq_id)

    def evict_one(self, blocks: BlockManager) -> bool:
        """Free the blocks of the oldest kept sample that holds any; False when none does."""
        for seq in self._seqs.values():
            if blocks.has(seq.seq_id):
                blocks.free(seq.seq_id)
                self.num_evicted += 1
                return True
        return False

    def num_holding(self, blocks: BlockManager) -> int:
        """Kept samples that still hold their KV."""
        return sum(blocks.has(s.seq_id) for s in self._seqs.values())
