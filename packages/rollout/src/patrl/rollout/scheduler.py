"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is a prefill step (new, preempted or imported sequences up to the token budget, the last
one possibly chunked; a prompt prefills once and its other samples fork it) or a decode step (one
token for every running sequence). Prefill goes first, so the batch refills as soon as sequences
finish. When KV blocks run out in decode, the most recently admitted sequence is preempted by
recompute. The scheduler is deterministic, so every rank of a TP group derives the same schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from patrl.kvstore import BlockManager
from patrl.rollout.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    # Copy-on-write moves the KV cache must perform before the forward writes.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # A sequence whose prefill was cut by the token budget; it holds its blocks and is
        # always continued first, so a preempted sequence can never wait on its blocks forever.
        self.prefilling: Sequence | None = None
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queues

    def add(self, seq: Sequence) -> None:
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
        }

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of every queue and free its blocks (abort, export)."""
        if self.prefilling is seq:
            self.prefilling = None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if self.blocks.has(seq.seq_id):
            self.blocks.free(seq.seq_id)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        samples = self.num_running_samples()
        candidates: list[Sequence] = [self.prefilling] if self.prefilling else []
        self.prefilling = None
        candidates += self.waiting
        computing: set[int] = set()  # prompt hashes whose prompt KV this step computes
        # fresh sequences whose whole prompt prefills in this step, by prompt hash
        leaders: dict[int, Sequence] = {}
        sharing = self.blocks.enable_prefix_caching
        for seq in candidates:
            if budget == 0:
                break
            continuing = self.blocks.has(seq.seq_id)  # a cut prefill holds its blocks
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
            if not continuing and full and (seqs or self.running):
                break
            if not continuing:
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

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        queue = list(self.running)
        while queue and len(seqs) < self.max_num_seqs:
            seq = queue.pop(0)
            while not self.blocks.can_append(seq.seq_id, 1):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                copies += self.blocks.append(seq.seq_id, [seq.last_token_id])
                seqs.append(seq)
        if not seqs:
            return None
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False, block_copies=copies)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------ after step

    def finish_prefill(self, seq: Sequence) -> None:
        """A sequence's prefill completed: it (and any fork children) decode from now on."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        for child in seq.fork_children:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        seq.fork_children = []

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        self.remove(seq)
