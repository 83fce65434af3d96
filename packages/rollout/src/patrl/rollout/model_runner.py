"""The model runner: turns a scheduled batch into sampled tokens on one TP rank.

It owns the model, the KV cache and the layout they are cut for: it builds a batch's inputs
and attention context, runs the forward, computes the logits, calls the sampler and checks
that the TP group's ranks agree. Scheduling and request bookkeeping stay in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from patrl.kvstore import KVCacheSpec, PagedKVCache
from patrl.rollout.config import EngineConfig
from patrl.rollout.cuda_graphs import DecodeGraphs, check_graph_gather
from patrl.rollout.host_memory import MMAP_THRESHOLD_BYTES, keep_freed_memory
from patrl.rollout.kv_budget import KVBudget, check_fits, cpu_kv_bytes, probe_for
from patrl.rollout.layers.attention.context import AttentionContext, HostBatch, upload
from patrl.rollout.layers.lora import saved_base_weights
from patrl.rollout.loader import checkpoint_dtype, load_model, load_weights
from patrl.rollout.models.causal_lm import CausalLM
from patrl.rollout.offload import HostCopy
from patrl.rollout.sampler import (
    SampleOutput,
    SamplePlan,
    SamplingParams,
    VerifyPlan,
    concat_samples,
    make_generator,
    plan_samples,
    plan_verify,
    sample,
    sample_planned,
    verify_planned,
)
from patrl.rollout.scheduler import ScheduledBatch
from patrl.rollout.sequence import Seq
from patrl.rollout.staging import Array, StepStaging
from patrl.tpreshard import GroupCache, ParallelLayout, kept_tensors, tp_broadcast
from patrl.tpreshard.comm import all_reduce

MAX_GRAPH_BATCH = 256  # largest captured decode batch (vLLM captures up to 512)


@dataclass(slots=True)
class Sampled:
    """The outcome of a batch whose `ready` entries (indices into the batch) reached their
    last token: one sampled token per sequence of `samplers` (a leader, then its forks)."""

    ready: list[int]
    samplers: list[Seq]
    out: SampleOutput


def verify_chunks(lens: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive runs [lo, hi) of sequences whose rows (`lens`) sum to at most `limit` each,
    taken greedily; a sequence with more rows than `limit` is a run of its own."""
    chunks: list[tuple[int, int]] = []
    lo, rows = 0, 0
    for i, n in enumerate(lens):
        if i > lo and rows + n > limit:
            chunks.append((lo, i))
            lo, rows = i, 0
        rows += n
    chunks.append((lo, len(lens)))
    return chunks


class ModelRunner:
    """Model, KV cache and layout of one rank; `run` is the forward of one batch."""

    def __init__(
        self, config: EngineConfig, layout: ParallelLayout, groups: GroupCache | None = None
    ) -> None:
        """`groups`: where `layout` comes from; their communicators are made before the KV
        cache is sized (every rank of the world builds its runner at once)."""
        self.config = config
        self.layout = layout
        self.device = config.torch_device()
        # On CPU the full-vocabulary logits go through the sampler in chunks of rows small
        # enough to stay under glibc's mmap ceiling (`_logits_and_samples`)
        self.sample_chunk_bytes: int | None = None
        self._logits_buffer = torch.empty(0)
        if self.device.type == "cpu" and config.tune_host_malloc:
            keep_freed_memory()
            self.sample_chunk_bytes = MMAP_THRESHOLD_BYTES
        dtype = config.torch_dtype(checkpoint_dtype(config.model))
        self.model: CausalLM = load_model(
            config.model,
            layout,
            attention=config.attention_backend,
            dtype=dtype,
            device=self.device,
            **config.lora_kwargs(),
        )
        mc = self.model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        if groups is not None:
            groups.connect(self.device)
        self.kv_budget: KVBudget | None = None  # set where the KV bytes come from memory
        self.kv_bytes = self._kv_bytes(groups)
        self.cache = self._build_cache()
        self.sleep_level = 0  # 1: the KV cache is freed, 2: the weights are on the host too
        self._host_weights: HostCopy | None = None
        self.graphs = self._decode_graphs(capture=True)
        # a step's indices go to the device in one copy; 48 bytes a token covers a prefill's
        self.staging = StepStaging(self.device, 48 * config.max_num_batched_tokens + (1 << 16))
        self.staging.reserve()

    def rebuild(self, layout: ParallelLayout, model: CausalLM | None = None) -> None:
        """Move to `layout`: the model is already cut for it (or is `model`); the KV cache is
        rebuilt empty, in the old one's storage (every sequence must have left it)."""
        self.check_awake("a layout change")
        self.layout = layout
        if model is not None:
            self.model = model
        self.cache = self._build_cache(reuse=self.cache)
        if self.graphs is not None:
            self.graphs = self._decode_graphs(capture=self.graphs.capture)

    def _decode_graphs(self, capture: bool) -> DecodeGraphs | None:
        """CUDA graphs for decode steps (`capture`), or, with `capture=False`, their eager twin
        (tests); None on CPU or with `enforce_eager` (see cuda_graphs)."""
        if capture and (self.device.type != "cuda" or self.config.enforce_eager):
            return None
        max_batch = min(self.config.max_num_seqs, MAX_GRAPH_BATCH)
        check_graph_gather(
            self.config.attention_backend, max_batch, self.max_model_len, self.cache.spec
        )
        return DecodeGraphs(self.model, self.cache, max_batch, self.max_model_len, capture=capture)

    def _build_cache(self, reuse: PagedKVCache | None = None) -> PagedKVCache:
        """The KV cache at the current layout, `kv_bytes` (or `num_kv_blocks`) large; `reuse`:
        a cache whose contents are dead, whose storage the new one takes over when large
        enough (see PagedKVCache)."""
        config = self.config
        spec, head_start = self._cache_spec()
        num_blocks = config.num_kv_blocks or spec.num_blocks_for(self.kv_bytes)
        check_fits(num_blocks, config.block_size, self.max_model_len, self.kv_budget)
        return PagedKVCache(
            spec,
            num_blocks,
            config.enable_prefix_caching,
            head_start,
            self.model.config.num_kv_heads,
            reuse,
        )

    def _cache_spec(self, tp: int | None = None) -> tuple[KVCacheSpec, int]:
        """This rank's KV cache spec at the current layout (or at TP size `tp`), and its
        first KV head."""
        mc = self.model.config
        tp, tp_rank = (self.layout.tp_size, self.layout.tp_rank) if tp is None else (tp, 0)
        if mc.num_kv_heads >= tp:
            local_heads = mc.num_kv_heads // tp
            head_start = tp_rank * local_heads
        else:  # fewer KV heads than ranks: each head is replicated on tp / kv ranks
            local_heads = 1
            head_start = tp_rank // (tp // mc.num_kv_heads)
        dtype = next(self.model.parameters()).dtype
        spec = KVCacheSpec(
            mc.num_layers, local_heads, mc.head_dim, self.config.block_size, dtype, self.device
        )
        return spec, head_start

    # ---------------------------------------------------------------- memory

    def _kv_bytes(self, groups: GroupCache | None) -> int:
        """The KV cache's bytes, kept across layouts: `kv_cache_memory_bytes`, else measured
        on a device (see kv_budget; the smallest over the ranks), else what the budgets can
        use at the smallest TP size of `groups` (`cpu_kv_bytes`; the same on every rank)."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        probe = probe_for(self.device) if config.num_kv_blocks is None else None
        if probe is None:
            smallest = min(groups.candidates) if groups is not None else self.layout.tp_size
            spec, _ = self._cache_spec(min(smallest, self.layout.tp_size))
            return cpu_kv_bytes(
                spec.bytes_per_block, config.block_size, config.max_num_seqs, self.max_model_len
            )
        activation = probe.peak_during(self._profile_run())
        memory = probe.read()  # the profile's throwaway cache is gone by now
        self.kv_budget = KVBudget(
            config.gpu_memory_utilization,
            memory.total,
            memory.total - memory.free,
            sum(p.nbytes for p in self.model.parameters()),
            activation,
            config.max_num_batched_tokens,
        )
        return self._smallest_over_ranks(self.kv_budget.kv_bytes, groups)

    def _smallest_over_ranks(self, n: int, groups: GroupCache | None) -> int:
        """The least `n` over every rank that may share a TP group with this one (the world of
        `groups`, else this TP group): a group's ranks must hold the same blocks."""
        group = groups.world_group() if groups is not None else self.layout.tp_group
        if group is None:
            return n
        least = torch.tensor([n], dtype=torch.int64, device=self.device)
        all_reduce(group, least, op=dist.ReduceOp.MIN)
        return int(least.item())

    def _profile_run(self) -> Callable[[], object]:
        """The profiling forward: `max_num_batched_tokens` prompt tokens, the first sequence's
        chunk reading a whole `max_model_len` context (the largest attention), then logits and
        sampling for up to `max_num_seqs` rows. Its throwaway cache is made here, outside the
        measured peak, and lives as long as the returned function."""
        config, bs, longest = self.config, self.config.block_size, self.max_model_len
        tokens = config.max_num_batched_tokens
        new = [min(tokens, longest)]
        while sum(new) < tokens:
            new.append(min(tokens - sum(new), longest))
        context = [longest, *new[1:]]
        tables: list[list[int]] = []
        slots: list[int] = []
        for n, c in zip(new, context, strict=True):
            first = sum(len(t) for t in tables)
            tables.append(list(range(first, first + -(-c // bs))))
            slots += [tables[-1][j // bs] * bs + j % bs for j in range(c - n, c)]
        spec, head_start = self._cache_spec()
        num_blocks = sum(len(t) for t in tables)
        cache = PagedKVCache(spec, num_blocks, False, head_start, self.model.config.num_kv_heads)
        ctx = AttentionContext.build(
            new,
            context,
            slot_mapping=slots,
            block_tables=tables,
            kv_cache=cache,
            device=self.device,
        )
        ids = upload(torch.zeros(tokens, dtype=torch.long), self.device)
        rows = min(tokens, config.max_num_seqs)

        @torch.inference_mode()
        def run() -> None:
            hidden = self.model(ids, ctx)
            logits = self.model.compute_logits(hidden[-rows:])
            sample(logits, [SamplingParams(temperature=1.0)] * rows, [make_generator(0)] * rows)

        return run

    def sleep(self, level: int) -> None:
        """Free the KV cache's storage (level 1), and move the weights to host memory, pinned
        on CUDA (level 2), until `wake_up`. The cache must hold no sequence."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (free the KV cache) or 2 (also move the weights to "
                f"host memory), got {level!r}"
            )
        if self.sleep_level:
            raise RuntimeError(f"the engine is already asleep (level {self.sleep_level})")
        if self.cache.blocks.num_used_blocks:
            raise RuntimeError(
                f"sleep() needs an idle engine: {self.cache.blocks.num_used_blocks} KV blocks "
                "are in use (finish, abort or export the requests first)"
            )
        self.cache.release()
        self._logits_buffer = torch.empty(0)
        if self.graphs is not None:
            self.graphs.reset()  # they read the released KV; their memory pool goes too
        if level == 2:
            model = self.model
            self._host_weights = HostCopy(
                [
                    *model.parameters(),
                    *model.buffers(),
                    *kept_tensors(model),
                    *saved_base_weights(model),
                ]
            )
        self.sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks to whoever needs them next

    def wake_up(self) -> None:
        """Undo `sleep`: the weights back where they were, bit for bit, and the KV cache
        allocated again, empty. A no-op on an engine that is awake."""
        if self._host_weights is not None:
            self._host_weights.restore()
            self._host_weights = None
        if self.sleep_level:
            self.cache.reallocate()
        self.sleep_level = 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors under their HF names into the model, cut for this layout."""
        if self.sleep_level == 2:
            self.check_awake("load_weights")
        load_weights(self.model, named_tensors)

    def check_awake(self, what: str) -> None:
        """Raise, naming `what`, while the engine is asleep."""
        if self.sleep_level:
            raise RuntimeError(
                f"{what} on an engine asleep at level {self.sleep_level} (sleep() freed its "
                "KV cache or weights): call wake_up() first"
            )

    def run(self, batch: ScheduledBatch) -> Sampled | None:
        """Forward `batch` (its KV written, its tokens marked computed) and sample for the
        sequences it completes; None for a prefill chunk that completes none.

        Everything the step needs on the device that the host knows beforehand (token ids,
        the attention indices, the rows to sample, the sampler's inputs) goes up in ONE copy
        (`self.staging`): which sequences complete is known before the forward, the rows to
        sample are staged only when they are not simply every row in order (a decode
        step's), and the sampler's temperatures, per-path rows and uniforms are planned on
        the host (`plan_samples`) before the forward, unless the sampler takes the rows in
        chunks (`sample_chunk_bytes`). A verify step's plan (`plan_verify`, per chunk of
        sequences) rides in the same copy, and so does the padded query layout where the
        attention backend reads one (sdpa's batched path): such a step makes one more only
        for its top-k / top-p rows' outcome."""
        self.check_awake("generating")
        blocks = self.cache.blocks
        self.cache.copy_blocks(batch.block_copies)
        host, input_ids = self._prepare(batch)
        ready: list[int] = []
        rows: list[int] = []
        samplers: list[Seq] = []
        extra: list[Array] = []
        plan: SamplePlan | None = None
        verify: list[VerifyPlan] = []
        verify_arrays: list[int] = []  # how many arrays each verify plan stages
        gather_last = gather_rows = False
        if batch.is_verify:
            verify = self._plan_verify(batch)
            for chunk_plan in verify:
                arrays = chunk_plan.arrays()
                verify_arrays.append(len(arrays))
                extra += arrays
        else:
            pairs = zip(batch.seqs, batch.num_new_tokens, strict=True)
            ready = [i for i, (s, n) in enumerate(pairs) if blocks.num_uncomputed(s.seq_id) == n]
            for row, i in enumerate(ready):
                for seq in (batch.seqs[i], *batch.seqs[i].fork_children):
                    rows.append(row)
                    samplers.append(seq)
            if ready:
                last = host.last_rows()
                gather_last = len(ready) != len(input_ids)  # else every row, in order
                if gather_last:
                    extra.append(Array([last[i] for i in ready], torch.int64))
                gather_rows = len(rows) != len(ready)  # forks share their leader's row
                if gather_rows:
                    extra.append(Array(rows, torch.int64))
                if len(samplers) <= self._chunk_rows(len(samplers)):
                    plan = plan_samples(
                        [s.params for s in samplers],
                        [s.generator for s in samplers],
                        self.model.lm_head.vocab_size,
                    )
                    extra += plan.arrays()
        graphs = self.graphs
        if graphs is not None and graphs.can_run(host):
            staged = self.staging.stage([*graphs.inputs(host, input_ids), *extra])
            hidden = graphs.forward(staged, host.num_seqs)
            extras = staged.tensors[len(staged.tensors) - len(extra) :]
        else:
            ctx, (ids, *extras) = AttentionContext.staged(
                host,
                self.staging,
                [Array(input_ids, torch.int64), *extra],
                padded=self.model.backend.wants_padded_queries(host),
            )
            hidden = self.model(ids, ctx)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            blocks.mark_computed(seq.seq_id, n)
        if batch.is_verify:
            given = iter(extras)
            staged_plans = [[next(given) for _ in range(n)] for n in verify_arrays]
            return self._verify(batch, hidden, verify, staged_plans)
        if not ready:
            return None
        staged_rows = iter(extras)
        if gather_last:
            hidden = hidden[next(staged_rows)]
        index = next(staged_rows) if gather_rows else None
        out = self._logits_and_samples(hidden, rows, samplers, index, plan, list(staged_rows))
        return Sampled(ready, samplers, self._agree_across_tp(out))

    def _plan_verify(self, batch: ScheduledBatch) -> list[VerifyPlan]:
        """A verify step's plans, one per chunk [lo, hi) of whole sequences (`verify_chunks`
        under `_chunk_rows`: one chunk without `sample_chunk_bytes`), planned before the
        forward in chunk order (each draws its sequences' uniforms, as verifying them would)."""
        seqs = batch.seqs
        drafts = [d.tokens for d in batch.drafts]
        lens = [1 + len(d) for d in drafts]
        vocab = self.model.lm_head.vocab_size
        return [
            plan_verify(
                drafts[lo:hi],
                [s.params for s in seqs[lo:hi]],
                [s.generator for s in seqs[lo:hi]],
                vocab,
            )
            for lo, hi in verify_chunks(lens, self._chunk_rows(sum(lens)))
        ]

    @torch.inference_mode()
    def _verify(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        plans: list[VerifyPlan],
        inputs: list[list[torch.Tensor]],
    ) -> Sampled:
        """A verify step's outcome: every row of `hidden` (each sequence's last sampled token
        and its draft) is a logits row, accepted or rejected by `verify_planned` as the
        chunks' `plans` say, with their staged `inputs` (each plan's arrays). The
        engine rolls back the slots of rejected tokens. It runs eagerly (CUDA graphs take
        one query token per sequence). With more than one chunk (`sample_chunk_bytes`, CPU),
        as in `_logits_and_samples`: one head matmul into the kept buffer, then the TP gather
        and `verify_planned` on each chunk's rows (a sequence's rows are verified together;
        every sequence is verified on its own, so chunks change no token)."""
        seqs = batch.seqs
        if len(plans) == 1:
            logits = self.model.compute_logits(hidden)
            out = verify_planned(logits, plans[0], inputs[0], self.staging)
        else:
            head = self.model.lm_head
            local = head.local(hidden, self._buffer(len(hidden), head.weight.shape[0], hidden))
            parts, row = [], 0
            for plan, chunk_inputs in zip(plans, inputs, strict=True):
                end = row + plan.rows
                logits = head.gather(local[row:end])
                parts.append(verify_planned(logits, plan, chunk_inputs, self.staging))
                row = end
            out = concat_samples(parts)
        return Sampled(list(range(len(seqs))), list(seqs), self._agree_across_tp(out))

    def _chunk_rows(self, rows: int) -> int:
        """The most full-vocabulary logit rows sampled at once: all `rows` without
        `sample_chunk_bytes`, else as many as keep a chunk's fp32 temporaries under it."""
        if self.sample_chunk_bytes is None:
            return rows
        return max(1, self.sample_chunk_bytes // (4 * self.model.lm_head.vocab_size) - 1)

    def _prepare(self, batch: ScheduledBatch) -> tuple[HostBatch, list[int]]:
        """The batch's attention layout, checked on the host, and its input token ids."""
        blocks = self.cache.blocks
        input_ids: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = blocks.num_computed(seq.seq_id)
            input_ids += blocks.token_ids(seq.seq_id)[start : start + n]
            slots += blocks.slot_mapping(seq.seq_id, start, start + n)
            context_lens.append(start + n)
        host = HostBatch.check(
            batch.num_new_tokens,
            context_lens,
            slot_mapping=slots,
            block_tables=[blocks.block_table(s.seq_id) for s in batch.seqs],
            kv_cache=self.cache,
        )
        return host, input_ids

    @torch.inference_mode()
    def _logits_and_samples(
        self,
        hidden: torch.Tensor,
        rows: list[int],
        samplers: list[Seq],
        index: torch.Tensor | None,
        plan: SamplePlan | None,
        inputs: list[torch.Tensor],
    ) -> SampleOutput:
        """One token for each of `samplers`, from the logits of its row of `hidden` (`rows`,
        in order; a prompt's forked samples share their leader's row; `index`: `rows` on the
        device, None when they are every row in order), as `plan` says with its staged
        `inputs`. Without a plan (`sample_chunk_bytes`, CPU, more rows than a chunk), the
        head writes this rank's logit columns into a buffer kept across steps and the TP
        gather and the sampler take them in chunks of rows, so no full-vocabulary temporary
        crosses glibc's mmap threshold (see host_memory). Every row is sampled on its own,
        from its own generator: chunks change no token."""
        if plan is not None:
            logits = self.model.compute_logits(hidden)
            return sample_planned(logits if index is None else logits[index], plan, inputs)
        params = [s.params for s in samplers]
        generators = [s.generator for s in samplers]
        head = self.model.lm_head
        limit = self._chunk_rows(len(samplers))
        local = head.local(hidden, self._buffer(len(hidden), head.weight.shape[0], hidden))
        size = -(-len(samplers) // -(-len(samplers) // limit))  # equal chunks
        parts = []
        for lo in range(0, len(samplers), size):
            hi = min(lo + size, len(samplers))
            first, end = rows[lo], rows[hi - 1] + 1  # rows only grow
            logits = head.gather(local[first:end])
            chunk = self._index([r - first for r in rows[lo:hi]])
            chunk_plan = plan_samples(params[lo:hi], generators[lo:hi], head.vocab_size)
            parts.append(sample_planned(logits[chunk], chunk_plan, staging=self.staging))
        return concat_samples(parts)

    def _index(self, rows: list[int]) -> torch.Tensor:
        """`rows` as an index tensor on the device (a Python list index would be a blocking
        copy on CUDA)."""
        return upload(torch.tensor(rows, dtype=torch.long), self.device)

    def _buffer(self, n: int, columns: int, like: torch.Tensor) -> torch.Tensor:
        """[n, columns] of a buffer kept across steps (grown, or remade after a switch)."""
        buf = self._logits_buffer
        if buf.shape[0] < n or buf.shape[1:] != (columns,) or buf.dtype != like.dtype:
            rows = max(n, self.config.max_num_seqs)
            buf = self._logits_buffer = like.new_empty((rows, columns))
        return buf[:n]

    def _agree_across_tp(self, out: SampleOutput) -> SampleOutput:
        """`out`, after checking that the group's first rank sampled the same: a divergence
        fails loudly instead of silently desynchronising the ranks. The tokens and logprobs
        cross the TP group as one device tensor (NCCL takes no host tensors; rows sampled on
        the host go up first); the comparison runs on the device and reads back one bool."""
        layout = self.layout
        if layout.tp_size == 1:
            return out
        out = out.on_device(self.staging)  # the rows sampled on the host are compared too
        columns = [out.tokens.double(), out.logprobs.double()]
        if out.emitted is not None:
            columns.append(out.emitted.double())
        mine = torch.stack(columns)
        first = tp_broadcast(layout, mine.clone(), src=0)
        if not torch.equal(first, mine):
            raise RuntimeError(
                f"TP rank {layout.tp_rank} sampled differently from its group's first rank: "
                "the ranks' logits or generator states diverged"
            )
        return out
