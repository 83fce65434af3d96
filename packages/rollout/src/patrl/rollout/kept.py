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
from collections.abc import Sequence as Ids
from typing import TYPE_CHECKING, Any

from patrl.kvstore import BlockManager, PagedKVCache
from patrl.rollout.request_input import encode, reject_reason, with_group_seed
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.sequence import IdCounter, Request, Seq, new_request

Key = tuple[str, int]  # (request id, sample index)


class KeptSequences:
    """Kept samples by (request id, sample index), oldest first; see the module docstring.
    Invariant: a kept sample's blocks, when it has any, hold exactly its tokens but the last
    sampled one, all computed."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[Key, Seq] = OrderedDict()
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

    def keep(self, seq: Seq, blocks: BlockManager) -> None:
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

    def get(self, key: Key) -> Seq | None:
        """A kept sample, left kept."""
        return self._seqs.get(key)

    def take(self, key: Key) -> Seq | None:
        """Remove and return a kept sample (its blocks, if any, now the caller's)."""
        return self._seqs.pop(key, None)

    def release(self, key: Key, blocks: BlockManager) -> None:
        """Forget a kept sample and free its blocks; KeyError when it is not kept."""
        seq = self._seqs.pop(key)
        if blocks.has(seq.seq_id):
            blocks.free(seq.seq_id)

    def drop_kv(self, blocks: BlockManager) -> None:
        """Free every kept sample's blocks, keeping its tokens (`rebuild`'s new cache):
        their continuations re-prefill."""
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


class KeptTurns:
    """The engine's kept-turn API (a mixin of `Engine`, which sets the attributes below):
    `add_request(..., keep=True)` keeps each sample that completes; `continue_request`
    extends one by new tokens, prefilling only those (and its last sampled token);
    `release` / `release_kept` free what is never continued. Every rank of a TP group makes
    the same calls, so the kept samples, their evictions and the continuations' schedules
    agree. `rebuild` keeps the kept samples' tokens, not their KV; `load_weights` keeps
    their KV, as it does running samples'; `sleep` needs them released first."""

    scheduler: Any  # a Scheduler (whose module imports this one)
    runner: Any
    config: Any
    layout: Any
    groups: Any
    device: Any
    model: Any
    max_model_len: int
    _requests: dict[str, Request]
    _seq_ids: IdCounter
    _request_ids: IdCounter

    if TYPE_CHECKING:  # Engine's own, declared for the type checker only

        @property
        def cache(self) -> PagedKVCache: ...

        def check_params(self, params: SamplingParams) -> None: ...

    def _group_rank(self) -> int:
        """Global rank of this TP group's first rank."""
        rank = self.groups.rank if self.groups is not None else 0
        return int(rank - self.layout.tp_rank)

    def continue_request(
        self,
        request_id: str,
        appended_token_ids: Ids[int],
        params: SamplingParams | None = None,
        new_request_id: str | None = None,
        keep: bool = False,
        sample_index: int = 0,
    ) -> str:
        """Continue kept sample `sample_index` of finished request `request_id` (added with
        `keep=True`) as a new one-sample request (`new_request_id`, generated if None) whose
        prompt is that sample's tokens then `appended_token_ids`; returns its id.

        Over the kept KV, its prefill computes exactly `1 + len(appended_token_ids)` tokens:
        the kept sample's last sampled token (whose KV no step wrote) and the appended ones.
        A kept sample whose KV was evicted (memory pressure, a `rebuild`) is prefilled
        from its tokens instead, finding what the prefix cache still holds; the tokens and
        logprobs are the same either way. `keep` keeps the continuation in its turn.
        KeyError when the sample is not kept; ValueError for params the engine cannot honour
        or n != 1."""
        params = params or SamplingParams()
        self.check_params(params)
        if params.n != 1:
            raise ValueError(f"a continuation samples one sequence: n must be 1, got {params.n}")
        key = (request_id, sample_index)
        kept = self.scheduler.kept
        if key not in kept:
            raise KeyError(
                f"no kept sample {sample_index} of request {request_id!r} in this engine "
                f"(add it with keep=True; kept: {kept.keys()[:8]})"
            )
        if new_request_id is None:
            new_request_id = f"req-{self._group_rank()}-{self._request_ids.take()}"
        if new_request_id in self._requests:
            raise ValueError(f"request id {new_request_id!r} is already in use")
        appended = encode(appended_token_ids, None, self.config.model)
        old = kept.take(key)
        assert old is not None
        drafter = self.scheduler.drafter
        params = with_group_seed(params, self.layout, self.device)
        token_ids = old.token_ids + appended
        request = new_request(new_request_id, token_ids, params, self._seq_ids, old.prompt_key)
        self._requests[new_request_id] = request
        seq = request.seqs[0]
        seq.seq_id, seq.keep = old.seq_id, keep  # the kept blocks are under its id
        blocks = self.cache.blocks
        request.error = reject_reason(token_ids, self.max_model_len, self.model.config.vocab_size)
        if request.error is not None:
            if blocks.has(seq.seq_id):
                blocks.free(seq.seq_id)
            if drafter is not None:
                drafter.drop(seq.seq_id)
            seq.finish("rejected")
            return new_request_id
        if drafter is not None:  # the conversation stays one sample of its prompt's group
            drafter.continue_sample(seq.seq_id, appended)
        if blocks.has(seq.seq_id):
            self.runner.check_awake("continue_request")
            new = [old.last_token_id, *appended]
            needed = blocks.num_blocks_to_append(seq.seq_id, len(new))
            if self.scheduler.make_room(needed):
                # a copy-on-write of a last block shared with a sibling happens now, before
                # any step writes into it
                self.cache.copy_blocks(blocks.append(seq.seq_id, new))
            else:  # no room to extend it now: queue it as a new prompt, as when evicted
                blocks.free(seq.seq_id)
                kept.num_evicted += 1
        self.scheduler.add(seq)
        return new_request_id

    def release(self, request_id: str) -> None:
        """Forget the kept samples of finished request `request_id` and free their KV (a
        conversation that ends without a continuation); KeyError when none is kept."""
        kept = self.scheduler.kept
        keys = [k for k in kept if k[0] == request_id]
        if not keys:
            raise KeyError(f"no kept sample of request {request_id!r} in this engine")
        for k in keys:
            self._release_kept(k)

    def release_kept(self) -> None:
        """Release every kept sample (the end of a multi-turn rollout, or its failure)."""
        for k in self.scheduler.kept:  # a copy of the keys
            self._release_kept(k)

    def _release_kept(self, key: Key) -> None:
        """Free kept sample `key`'s KV; its conversation, complete, leaves the drafter's
        group and joins its prompt's history."""
        kept = self.scheduler.kept
        seq = kept.get(key)
        if self.scheduler.drafter is not None and seq is not None:
            self.scheduler.drafter.finish(seq.seq_id, seq.output_token_ids, remember=True)
        kept.release(key, self.cache.blocks)

    def kept_request_ids(self) -> list[str]:
        """Finished requests with a kept sample, oldest first."""
        return self.scheduler.kept.request_ids()
