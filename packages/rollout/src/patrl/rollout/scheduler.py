"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is a prefill step (new, preempted or imported sequences up to the token budget, the last
one possibly chunked; a prompt prefills once and its other samples fork it) or a decode step (one
token for every running sequence, plus, with a drafter, the draft each one verifies: slots for
1 + d tokens, inside the token budget and the blocks left once every sequence has its slot). Prefill goes first, so the batch refills as soon as sequences finish. When KV blocks run out in decode, the most recently admitted sequence is preempted by
recompute, after every kept sample (a finished turn held for its continuation, `kept`) has
lost its KV. The scheduler is deterministic, so every rank of a TP group derives the same schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from patrl.kvstore import BlockManager
from patrl.rollout.drafter import Draft, Drafter
from patrl.rollout.kept import KeptSequences
from patrl.rollout.sequence import Seq, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Seq]
    num_new_tokens: list[int]
    is_prefill: bool
    # Copy-on-write moves the KV cache must perform before the forward writes.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # A verify step (decode with drafts): each sequence's draft, its tokens after the last
    # sampled one in the batch (num_new_tokens = 1 + len(draft.tokens)); empty otherwise.
    drafts: list[Draft] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_verify(self) -> bool:
        return any(d.tokens for d in self.drafts)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        drafter: Drafter | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`drafter`: drafts for decode steps of at most its `max_num_seqs` running sequences
        (0: any), each cut to what the sequence may still emit (`max_model_len`, max_tokens)."""
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        # A sequence whose prefill was cut by the token budget; it holds its blocks and is
        # always continued first, so a preempted sequence can never wait on its blocks forever.
        self.prefilling: Seq | None = None
        self.num_preemptions = 0
        self.kept = KeptSequences()

    # ----------------------------------------------------------------- queues

    def add(self, seq: Seq) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def num_running_samples(self) -> int:
        return sum(s.group_size for s in self.running)

    def stats(self) -> dict[str, float]:
        """Samples running and waiting, KV blocks in use and free, prefix hits, preemptions."""
        waiting = sum(s.group_size for s in self.waiting)
        return {
            "running": self.num_running_samples(),
            "waiting": waiting + (self.prefilling.group_size if self.prefilling else 0),
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks,
            "prefix_hit_rate": self.blocks.prefix_hit_rate(),
            "num_preemptions": self.num_preemptions,
            "kept": len(self.kept),
            "kept_evicted": self.kept.num_evicted,
            **(self.drafter.counts.stats() if self.drafter is not None else {}),
        }

    def remove(self, seq: Seq, free: bool = True) -> None:
        """Take a sequence out of every queue and free its blocks (abort, export; `free`
        False: a sample kept with its blocks, which stays in the drafter's group for its
        continuation, `Drafter.continue_sample`)."""
        if self.prefilling is seq:
            self.prefilling = None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if free and self.blocks.has(seq.seq_id):
            self.blocks.free(seq.seq_id)
        if self.drafter is not None and free:  # a complete response is history
            remember = seq.finish_reason in ("stop", "length")
            self.drafter.finish(seq.seq_id, seq.output_token_ids, remember)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Seq] = []
        counts: list[int] = []
        samples = self.num_running_samples()
        cut = self.prefilling
        candidates: list[Seq] = [cut] if cut else []
        self.prefilling = None
        candidates += self.waiting
        computing: set[int] = set()  # prompt hashes whose prompt KV this step computes
        # fresh sequences whose whole prompt prefills in this step, by prompt hash
        leaders: dict[int, Seq] = {}
        sharing = self.blocks.enable_prefix_caching
        for seq in candidates:
            if budget == 0:
                break
            # a cut prefill holds its blocks, and so does a kept sample's continuation
            continuing = self.blocks.has(seq.seq_id)
            leader = leaders.get(seq.prompt_hash) if sharing and not continuing else None
            if (
                leader is not None
                and not seq.output_token_ids
                and seq.prompt_token_ids == leader.prompt_token_ids
                and samples + seq.group_size <= self.max_num_seqs
            ):
                # Another request of a prompt that prefills in full in this step (a GRPO
                # group sent as n requests of one sample, as TRL does): its samples draw
                # their first tokens from the same logits and take over the prompt's blocks,
                # as the samples of one request do. Nothing to compute.
                samples += seq.group_size
                leader.fork_children += [seq, *seq.fork_children]
                seq.fork_children = []
                self.waiting.remove(seq)
                continue
            if not continuing and seq.prompt_hash in computing:
                # The same prompt prefills in this step, and this sample has tokens of its
                # own (recomputed after a reconfiguration or a preemption): wait one step and
                # find the prompt in the prefix cache instead of computing it once more.
                continue
            full = samples + seq.group_size > self.max_num_seqs
            # A group larger than max_num_seqs still runs when nothing else does.
            if seq is not cut and full and (seqs or self.running):
                break
            if not continuing:
                while not self.blocks.can_allocate(seq.token_ids) and (
                    self.kept.evict_one(self.blocks) or self._unhold_waiting(seqs)
                ):
                    pass
                if not self.blocks.can_allocate(seq.token_ids):
                    break
                # The cached count is what allocate says now (it can differ from a count taken
                # before the call: nano-vllm #211).
                cached = self.blocks.allocate(seq.seq_id, seq.token_ids)
                shareable = len(seq.prompt_token_ids) // self.blocks.block_size
                if (
                    self.blocks.enable_prefix_caching
                    and cached < shareable * self.blocks.block_size
                ):
                    computing.add(seq.prompt_hash)  # its prompt is computed in this step
            remaining = self.blocks.num_uncomputed(seq.seq_id)
            take = min(remaining, budget)
            seqs.append(seq)
            counts.append(take)
            budget -= take
            samples += seq.group_size
            if take < remaining:
                self.prefilling = seq
                break
            if not seq.output_token_ids:
                leaders.setdefault(seq.prompt_hash, seq)
        for seq in seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
        if not seqs:
            return None
        return ScheduledBatch(seqs, counts, is_prefill=True)

    def _unhold_waiting(self, scheduled: list[Seq]) -> bool:
        """Free the blocks of the newest waiting continuation that holds kept KV and is not
        in this step's batch (it then prefills from its tokens, as an evicted one does), so
        that a waiting sequence never waits on blocks that only waiting ones hold; whether
        one was freed."""
        for seq in reversed(self.waiting):
            if self.blocks.has(seq.seq_id) and all(seq is not s for s in scheduled):
                self.blocks.free(seq.seq_id)
                self.kept.num_evicted += 1
                return True
        return False

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs: list[Seq] = []
        copies: list[tuple[int, int]] = []
        queue = list(self.running)
        while queue and len(seqs) < self.max_num_seqs:
            seq = queue.pop(0)
            while not self.blocks.can_append(seq.seq_id, 1):
                if self.kept.evict_one(self.blocks):
                    continue
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                copies += self.blocks.append(seq.seq_id, [seq.last_token_id])
                seqs.append(seq)
        if not seqs:
            return None
        drafts = self._drafts(seqs)
        for seq, draft in zip(seqs, drafts, strict=True):
            copies += self.blocks.append(seq.seq_id, draft.tokens)  # no copy: already private
        counts = [1 + len(d.tokens) for d in drafts]
        return ScheduledBatch(seqs, counts, is_prefill=False, block_copies=copies, drafts=drafts)

    def _drafts(self, seqs: list[Seq]) -> list[Draft]:
        """The step's drafts, one per sequence (empty ones where it has none): only when the
        drafter speculates at this batch size and expects the step to pay; inside the token
        budget and the free blocks left once every sequence has its own slot (a draft never
        preempts)."""
        drafter = self.drafter
        none = [Draft([]) for _ in seqs]
        if drafter is None or not drafter.speculates(len(seqs)):
            return none
        # every sample registered (one imported with its KV is new here) and indexed, in order
        for seq in seqs:
            drafter.observe(seq)
        context = sum(s.num_tokens for s in seqs)
        if not drafter.may_pay([s.seq_id for s in seqs], context):
            return none  # no draft could pay: spare the lookups
        spare = self.max_num_batched_tokens - len(seqs)
        free = self.blocks.num_free_blocks
        drafts = []
        for seq in seqs:
            draft = self._draft(seq, spare)
            needed = self.blocks.num_blocks_to_append(seq.seq_id, len(draft.tokens))
            if needed > free:
                draft = Draft([])
            free -= needed
            spare -= len(draft.tokens)
            drafts.append(draft)
        return drafts if drafter.pays([len(d.tokens) for d in drafts], context) else none

    def _draft(self, seq: Seq, spare: int) -> Draft:
        """`seq`'s draft: no longer than the `spare` token budget or than what the sequence
        may still emit less one (the step's own token)."""
        assert self.drafter is not None
        room = seq.params.max_tokens - len(seq.output_token_ids)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens)
        limit = min(spare, room - 1)
        if limit <= 0:
            return Draft([])
        return self.drafter.propose(seq.seq_id, seq.last_tokens(self.drafter.max_n), limit)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------ after step

    def finish_prefill(self, seq: Seq) -> None:
        """A sequence's prefill completed: it (and any fork children) decode from now on."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        for child in seq.fork_children:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        seq.fork_children = []

    def finish(self, seq: Seq, reason: str) -> None:
        """End `seq` for `reason`; a `keep` sample that completed ("stop", "length") is
        kept with its blocks (`kept`), any other is freed."""
        seq.finish(reason)
        keep = seq.keep and reason in ("stop", "length")
        self.remove(seq, free=not keep)
        if keep:
            self.kept.keep(seq, self.blocks)

    def make_room(self, num_blocks: int) -> bool:
        """Evict kept samples' KV, oldest first, until `num_blocks` blocks are free;
        whether they are."""
        while self.blocks.num_free_blocks < num_blocks and self.kept.evict_one(self.blocks):
            pass
        return self.blocks.num_free_blocks >= num_blocks

    def settle(
        self, seq: Seq, emitted: int, reason: str | None, draft: Draft | None = None
    ) -> None:
        """After a step gave `seq` `emitted` tokens: finish it for `reason`, else roll back
        the slots of its rejected draft tokens (`draft`: what a decode step verified; None in
        a prefill step); the drafter indexes the new tokens and counts the step."""
        if self.drafter is not None:
            self.drafter.observe(seq)
            if draft is not None:
                self.drafter.record(seq.seq_id, draft, emitted - 1, emitted)
        if reason is not None:
            self.finish(seq, reason)
        elif draft is not None and draft.tokens:
            self.blocks.truncate(seq.seq_id, len(draft.tokens) + 1 - emitted)
