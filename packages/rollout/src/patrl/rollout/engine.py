"""The generation engine of one rollout replica: requests in, completions with logprobs out.

One `Engine` runs on one TP group. Every rank of the group holds the same scheduler state and
makes the same scheduling decisions (the scheduler is deterministic). Every rank has the full
logits and the same generator states, so every rank samples the same tokens; the group's first
rank's tokens are broadcast anyway and compared, so a divergence fails loudly instead of
silently desynchronising the ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from patrl.kvstore import KVCacheSpec, PagedKVCache
from patrl.rollout.adaptive import (
    Lengths,
    Planner,
    TPController,
    default_lengths,
    make_planner,
    usable_candidates,
)
from patrl.rollout.config import EngineConfig
from patrl.rollout.host_memory import MMAP_THRESHOLD_BYTES, keep_freed_memory
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.loader import (
    load_model,
    load_weights,
    read_eos_token_ids,
    read_tokenizer,
    weight_keys,
)
from patrl.rollout.migrate import cut_and_migrate
from patrl.rollout.models import build_model
from patrl.rollout.models.causal_lm import CausalLM
from patrl.rollout.outputs import CompletionOutput, RequestOutput, SequenceState
from patrl.rollout.reconfigure import KVPolicy, ReconfigReport, check_target, reconfigure
from patrl.rollout.sampler import (
    SampleOutput,
    SamplingParams,
    concat_samples,
    export_generator,
    import_generator,
    make_generator,
    sample,
)
from patrl.rollout.scheduler import ScheduledBatch, Scheduler
from patrl.rollout.sequence import Sequence as Seq
from patrl.rollout.sequence import SequenceStatus
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.tpreshard import (
    GroupCache,
    ParallelLayout,
    restore_full_,
    single_process_layout,
    tp_broadcast,
)
from patrl.tpreshard.comm import gather_objects

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    seqs: dict[int, Seq] = field(default_factory=dict)  # by sample index
    error: str | None = None

    def done(self) -> bool:
        return all(s.is_finished for s in self.seqs.values())


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, for the generation timeline."""

    t: float  # seconds since the timeline started
    duration_s: float
    running: int  # samples running after the step
    num_tokens: int  # tokens run through the model
    is_prefill: bool
    tp_size: int


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # tokens run through the model in prefill steps
    decode_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        layout: ParallelLayout | None = None,
        groups: GroupCache | None = None,
        planner: Planner | None = None,
        lengths: Lengths | None = None,
    ) -> None:
        """`layout`: this rank's TP group (default: one process). `groups`: every group a
        later `reconfigure(tp)` may use, made at start-up (see GroupCache). Under
        `tp_policy=adaptive`, every rank of the world builds its engine at once (the groups are
        made here when not given); `planner` and `lengths` replace the planner built from
        `tp_policy.profile` and the online LengthPredictor (tests, oracle benchmarks)."""
        self.config = config
        self.groups = groups
        self.controller: TPController | None = None
        policy = config.tp_policy
        if isinstance(policy, AdaptiveTP):
            layout = self._adaptive_setup(policy, layout, planner, lengths)
        elif policy.tp is not None and (layout.tp_size if layout else 1) != policy.tp:
            raise ValueError(
                f"tp_policy static tp={policy.tp} but the engine's layout has "
                f"tp_size={layout.tp_size if layout else 1}"
            )
        self.layout = layout or single_process_layout()
        self.reconfiguring = False
        self._return_to: ParallelLayout | None = None  # see return_later
        self.device = config.torch_device()
        # On CPU the full-vocabulary logits go through the sampler in chunks of rows small
        # enough to stay under glibc's mmap ceiling (`_logits_and_samples`)
        self.sample_chunk_bytes: int | None = None
        self._logits_buffer = torch.empty(0)
        if self.device.type == "cpu" and config.tune_host_malloc:
            keep_freed_memory()
            self.sample_chunk_bytes = MMAP_THRESHOLD_BYTES
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model = load_model(
            config.model,
            self.layout,
            attention=config.attention_backend,
            dtype=dtype,
            device=self.device,
        )
        mc = self.model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        self.tokenizer = _maybe_tokenizer(config.model)
        self.eos_token_ids = frozenset(read_eos_token_ids(config.model))
        self.cache = self._build_cache()
        self.scheduler = Scheduler(
            self.cache.blocks, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.weight_version = 0
        self.counters = EngineCounters()
        self._requests: dict[str, _Request] = {}
        # Per-step records of the latest `generate` call (or since `reset_timeline`).
        self.timeline: list[StepRecord] = []
        self._timeline_start = time.perf_counter()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def _adaptive_setup(
        self,
        policy: AdaptiveTP,
        layout: ParallelLayout | None,
        planner: Planner | None,
        lengths: Lengths | None,
    ) -> ParallelLayout | None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if self.groups is not None:
            world_size = self.groups.world_size
        candidates = usable_candidates(policy.candidates, world_size)
        if len(candidates) < 2:
            if world_size > 1 or (layout is not None and layout.tp_size > 1):
                raise ValueError(
                    f"tp_policy adaptive: candidates {policy.candidates} leave fewer than two "
                    f"TP sizes that divide the world size {world_size}"
                )
            return layout  # one process: nothing to adapt, the engine runs as static tp=1
        policy = policy.model_copy(update={"candidates": candidates})
        if self.groups is None:
            self.groups = GroupCache(candidates, tp_comm=self.config.tp_comm)
        missing = [tp for tp in candidates if tp not in self.groups.candidates]
        if missing:
            raise ValueError(
                f"tp_policy adaptive: candidate TP sizes {missing} are not in the GroupCache's "
                f"{self.groups.candidates}"
            )
        start = self.groups.layout(policy.start_tp)
        if layout is not None and layout != start:
            raise ValueError(
                f"tp_policy adaptive starts at tp={policy.start_tp} (the smallest candidate), "
                f"but the engine was given a layout with tp_size={layout.tp_size}: pass "
                "groups.layout(min(candidates)) or no layout"
            )
        planner = planner or make_planner(policy, world_size, self.config.max_num_seqs)
        self.controller = TPController(
            policy,
            planner,
            lengths or default_lengths(),
            self.groups.world_group(),
            self.groups.world_comm(),
            self.config.block_size if self.config.enable_prefix_caching else 0,
        )
        return start

    def _build_cache(self, reuse: PagedKVCache | None = None) -> PagedKVCache:
        """The KV cache at the current layout; `reuse`: a cache whose contents are dead, whose
        storage the new one takes over when large enough (see PagedKVCache)."""
        mc, tp, config = self.model.config, self.layout.tp_size, self.config
        if mc.num_kv_heads >= tp:
            local_heads = mc.num_kv_heads // tp
            head_start = self.layout.tp_rank * local_heads
        else:  # fewer KV heads than ranks: each head is replicated on tp / kv ranks
            local_heads = 1
            head_start = self.layout.tp_rank // (tp // mc.num_kv_heads)
        dtype = next(self.model.parameters()).dtype
        spec = KVCacheSpec(
            mc.num_layers, local_heads, mc.head_dim, config.block_size, dtype, self.device
        )
        num_blocks = config.num_kv_blocks or spec.num_blocks_for(config.kv_cache_memory_bytes)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks x block_size={config.block_size} = "
                f"{num_blocks * config.block_size} tokens) cannot hold one max_model_len="
                f"{self.max_model_len} sequence: raise num_kv_blocks or kv_cache_memory_bytes, "
                "or lower max_model_len"
            )
        return PagedKVCache(
            spec, num_blocks, config.enable_prefix_caching, head_start, mc.num_kv_heads, reuse
        )

    # ------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_key: str | None = None,
    ) -> str:
        """Queue a request of `params.n` samples; returns its id.

        A request that cannot run (empty, too long for max_model_len, token ids outside the
        vocabulary) is not an exception: it finishes at the next `step` with finish_reason
        "rejected" and the reason in `RequestOutput.error`, and the batch goes on.

        Generated ids are unique across the world's replicas (requests of several replicas
        meet in one engine after a reconfiguration). `prompt_key` names the prompt for the
        length predictor of adaptive TP (the same key in later rollouts: its history).
        """
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._group_rank()}-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.seed is None and params.temperature > 0 and self.layout.tp_size > 1:
            # The TP group samples as one replica: its ranks must draw the same stream, so the
            # group's first rank picks the seed (every rank adds the same requests in order).
            # (an OS-random seed: drawing from torch's global generator would shift the
            # trainer's stream, which shares this process)
            drawn = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
            params = dataclasses.replace(
                params, seed=int(tp_broadcast(self.layout, drawn, src=0).item())
            )
        token_ids = self._encode(prompt)
        request = _Request(request_id, token_ids)
        self._requests[request_id] = request
        seqs = [self._new_seq(request_id, i, token_ids, params) for i in range(params.n)]
        request.seqs = {s.sample_index: s for s in seqs}
        request.error = self._reject_reason(token_ids)
        if self.controller is not None and self.controller.in_rollout:
            self.controller.note_request(request_id, prompt_key or request_id, params.n)
        if request.error is not None:
            for s in seqs:
                s.finish("rejected")
            return request_id
        leader = seqs[0]
        leader.fork_children = seqs[1:]  # prefilled once, forked when the prefill is done
        self.scheduler.add(leader)
        return request_id

    def _group_rank(self) -> int:
        """Global rank of this TP group's first rank."""
        rank = self.groups.rank if self.groups is not None else 0
        return rank - self.layout.tp_rank

    def _new_seq(
        self, request_id: str, index: int, tokens: list[int], params: SamplingParams
    ) -> Seq:
        seed = None if params.seed is None else params.seed + index
        return Seq(
            next(self._seq_ids), request_id, index, list(tokens), params, make_generator(seed)
        )

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: pass token ids, not text")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _reject_reason(self, token_ids: list[int]) -> str | None:
        if not token_ids:
            return "empty prompt"
        if len(token_ids) >= self.max_model_len:
            return (
                f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
        return None

    def abort(self, request_id: str) -> None:
        """Stop a request; it is returned by the next `step` with finish_reason "abort"."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        for seq in request.seqs.values():
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that finished."""
        batch = self.scheduler.schedule()
        if batch is not None:
            start = time.perf_counter()
            self._run(batch)
            end = time.perf_counter()
            self.counters.busy_s += end - start
            self.timeline.append(
                StepRecord(
                    start - self._timeline_start,
                    end - start,
                    self.scheduler.num_running_samples(),
                    batch.num_tokens,
                    batch.is_prefill,
                    self.layout.tp_size,
                )
            )
        return self._collect_finished()

    def reset_timeline(self) -> None:
        self.timeline = []
        self._timeline_start = time.perf_counter()

    def _run(self, batch: ScheduledBatch) -> None:
        blocks = self.cache.blocks
        self.cache.copy_blocks(batch.block_copies)
        input_ids: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = blocks.num_computed(seq.seq_id)
            input_ids += blocks.token_ids(seq.seq_id)[start : start + n]
            slots += blocks.slot_mapping(seq.seq_id, start, start + n)
            context_lens.append(start + n)
        ctx = AttentionContext.build(
            batch.num_new_tokens,
            context_lens,
            slot_mapping=slots,
            block_tables=[blocks.block_table(s.seq_id) for s in batch.seqs],
            kv_cache=self.cache,
            device=self.device,
        )
        hidden = self.model(torch.tensor(input_ids, device=self.device), ctx)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            blocks.mark_computed(seq.seq_id, n)
        self._count(batch)

        ready = [i for i, s in enumerate(batch.seqs) if blocks.num_uncomputed(s.seq_id) == 0]
        if not ready:
            return  # a prefill chunk that did not reach the end of its sequence
        last = ctx.last_token_indices()[ready]
        rows: list[int] = []
        samplers: list[Seq] = []
        for row, i in enumerate(ready):
            for seq in (batch.seqs[i], *batch.seqs[i].fork_children):
                rows.append(row)
                samplers.append(seq)
        out = self._agree_across_tp(self._logits_and_samples(hidden[last], rows, samplers))

        if batch.is_prefill:
            for i in ready:
                leader = batch.seqs[i]
                if leader.fork_children:
                    blocks.fork(leader.seq_id, [c.seq_id for c in leader.fork_children])
                self.scheduler.finish_prefill(leader)
        self._postprocess(samplers, out)

    @torch.inference_mode()
    def _logits_and_samples(
        self, hidden: torch.Tensor, rows: list[int], samplers: list[Seq]
    ) -> SampleOutput:
        """One token for each of `samplers`, from the logits of its row of `hidden` (`rows`,
        in order; a prompt's forked samples share their leader's row).

        With `sample_chunk_bytes` (CPU) and more rows than fit under it, the head's matmul
        writes this rank's logit columns into a buffer kept across steps, and the gather
        across TP and the sampler take them in chunks of rows, so no full-vocabulary
        temporary reaches glibc's mmap threshold. Above it glibc maps every allocation afresh
        and unmaps it on free, 32 MB is the most the threshold can be (host_memory), and a step
        of 64 rows of a 152k vocabulary (39 MB for each of the logits, their gather, the
        log-softmax, the CDF) paid page faults on fresh memory for all of them: a TP=2 step of
        64 sequences of vocab_2l_h512 took 139-187 ms, and 98 ms with mmap off. One matmul,
        not one a chunk: each streams the whole head weight, and a few rows cost nearly a
        row's time each. Every row is sampled on its own (`sample`): chunks change no token."""
        params = [s.params for s in samplers]
        generators = [s.generator for s in samplers]
        head = self.model.lm_head
        limit = len(samplers)
        if self.sample_chunk_bytes is not None:
            limit = max(1, self.sample_chunk_bytes // (4 * head.vocab_size) - 1)
        if len(samplers) <= limit:
            return sample(self.model.compute_logits(hidden)[rows], params, generators)
        local = head.local(hidden, self._buffer(len(hidden), head.weight.shape[0], hidden))
        size = -(-len(samplers) // -(-len(samplers) // limit))  # equal chunks
        parts = []
        for lo in range(0, len(samplers), size):
            hi = min(lo + size, len(samplers))
            first, end = rows[lo], rows[hi - 1] + 1  # rows only grow
            logits = head.gather(local[first:end])
            chunk = [r - first for r in rows[lo:hi]]
            parts.append(sample(logits[chunk], params[lo:hi], generators[lo:hi]))
        return concat_samples(parts)

    def _buffer(self, n: int, columns: int, like: torch.Tensor) -> torch.Tensor:
        """[n, columns] of a buffer kept across steps (grown, or remade after a switch)."""
        buf = self._logits_buffer
        if buf.shape[0] < n or buf.shape[1:] != (columns,) or buf.dtype != like.dtype:
            rows = max(n, self.config.max_num_seqs)
            buf = self._logits_buffer = like.new_empty((rows, columns))
        return buf[:n]

    def _postprocess(self, seqs: list[Seq], out: SampleOutput) -> None:
        tokens = out.tokens.tolist()
        logprobs = out.logprobs.tolist()
        for row, seq in enumerate(seqs):
            top = None
            if seq.params.logprobs and out.top_ids is not None and out.top_logprobs is not None:
                k = seq.params.logprobs
                top = dict(
                    zip(
                        out.top_ids[row, :k].tolist(),
                        out.top_logprobs[row, :k].tolist(),
                        strict=True,
                    )
                )
            seq.append_token(tokens[row], logprobs[row], top)
            seq.weight_version = self.weight_version
            self.counters.generated_tokens += 1
            reason = seq.check_stop(self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)

    def _count(self, batch: ScheduledBatch) -> None:
        c = self.counters
        c.steps += 1
        if batch.is_prefill:
            c.prefill_steps += 1
            c.prefill_tokens += batch.num_tokens
        else:
            c.decode_steps += 1
            c.decode_tokens += batch.num_tokens

    def _agree_across_tp(self, out: SampleOutput) -> SampleOutput:
        layout = self.layout
        if layout.tp_size == 1:
            return out
        mine = torch.stack([out.tokens.double(), out.logprobs.double()]).cpu()
        first = tp_broadcast(layout, mine.clone(), src=0)
        if not torch.equal(first, mine):
            raise RuntimeError(
                f"TP rank {layout.tp_rank} sampled differently from its group's first rank: "
                "the ranks' logits or generator states diverged"
            )
        return out

    def _collect_finished(self) -> list[RequestOutput]:
        done = [r for r in self._requests.values() if r.done()]
        for r in done:
            del self._requests[r.request_id]
        return [self._output(r) for r in done]

    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for index in sorted(request.seqs):
            s = request.seqs[index]
            completions.append(
                CompletionOutput(
                    index=index,
                    token_ids=list(s.output_token_ids),
                    logprobs=list(s.output_logprobs),
                    finish_reason=s.finish_reason or "abort",
                    text=self._decode(s.output_token_ids),
                    top_logprobs=list(s.output_top_logprobs) if s.params.logprobs else None,
                    num_preemptions=s.num_preemptions,
                    time_to_first_token_s=None
                    if s.first_token_time is None
                    else s.first_token_time - s.arrival_time,
                    latency_s=None if s.finish_time is None else s.finish_time - s.arrival_time,
                )
            )
        return RequestOutput(
            request.request_id, request.prompt_token_ids, completions, request.error
        )

    def _decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # -------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        prompt_keys: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of `prompts`.

        Under `tp_policy=adaptive` this is a collective over the world: every rank calls it
        (with its replica's prompts, possibly none) and the planner may change the layout
        while it runs; the engine goes back to where the next rollouts open lazily (at the
        next full weight sync, or else at the next rollout's start).
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        keys: Sequence[str | None] = (
            prompt_keys if prompt_keys is not None else [None] * len(prompts)
        )
        if len(keys) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(keys)} prompt keys")
        self.reset_timeline()
        if self.controller is not None:
            return self._generate_adaptive(prompts, params, keys, progress)
        ids = [
            self.add_request(p, sp, prompt_key=k)
            for p, sp, k in zip(prompts, params, keys, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if progress and self.layout.is_tp_first else None
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.set_postfix(
                    running=self.scheduler.num_running_samples(), tok_s=f"{self.tokens_per_s():.0f}"
                )
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def _generate_adaptive(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        keys: Sequence[str | None],
        progress: bool,
    ) -> list[RequestOutput]:
        controller = self.controller
        assert controller is not None
        if self.has_unfinished():
            raise RuntimeError(
                "adaptive generate() needs an idle engine: requests added with add_request() "
                "are still unfinished"
            )
        controller.stats.reset_s += self.settle_layout()
        controller.begin()
        ids = self._add_replica_requests(prompts, params, keys)
        bar = (
            _progress_bar(len(ids)) if progress and self.groups and self.groups.rank == 0 else None
        )
        results = controller.run(self, on_finished=(lambda _: bar.update(1)) if bar else None)
        if controller.split:
            results = controller.hand_back(results, ids)
        controller.end(self, reopen=True)
        if bar is not None:
            bar.close()
        lost = [i for i in ids if i not in results]
        if lost:
            raise RuntimeError(
                f"requests {lost[:5]} were not handed back after the rollout (they finished "
                "on no replica, or on one that did not return them): this is a bug"
            )
        return [results[i] for i in ids]

    def _add_replica_requests(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        keys: Sequence[str | None],
    ) -> list[str]:
        """Queue this rank's requests at the start of an adaptive rollout; returns their ids.

        At tp 1 every rank is its own replica. A rollout may open at a larger TP (the layout the
        last rollout's first check chose for its whole batch): then the TP group is one replica,
        so every rank's requests are gathered, in TP-rank order, and queued on every rank of the
        group, as a switch at the first check would have merged them. Ids are drawn from the
        submitting rank's counter and global rank, and a missing seed is drawn by the submitting
        rank, so every rank of the group holds the same requests and generator streams."""
        layout = self.layout
        if layout.tp_size == 1:
            return [
                self.add_request(p, sp, prompt_key=k)
                for p, sp, k in zip(prompts, params, keys, strict=True)
            ]
        assert self.groups is not None  # adaptive engines always have a GroupCache
        mine = []
        for p, sp, k in zip(prompts, params, keys, strict=True):
            if sp.seed is None:
                sp = dataclasses.replace(sp, seed=secrets.randbits(62))
            rid = f"req-{self.groups.rank}-{next(self._request_ids)}"
            mine.append((p, sp, k, rid))
        gathered = gather_objects(layout.tp_comm, layout.tp_group, (mine, self.next_seq_id()))
        self._seq_ids = itertools.count(max(g[1] for g in gathered))
        for part, _ in gathered:
            for p, sp, k, rid in part:
                self.add_request(p, sp, request_id=rid, prompt_key=k)
        return [m[3] for m in mine]

    def generate_partial(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        quota: int,
        request_ids: Sequence[str] | None = None,
        prompt_keys: Sequence[str] | None = None,
        resume: Sequence[SequenceState] = (),
    ) -> tuple[list[RequestOutput], list[SequenceState]]:
        """A partial rollout (APRIL): continue `resume` (earlier rollouts' unfinished samples,
        queued first, their KV recomputed under the current weights), then run `prompts`,
        until `quota` requests have finished (under adaptive TP: until the world has finished
        the sum of every rank's replica's quota). Returns the finished requests and every
        sample of the unfinished ones (tokens, logprobs and generator state; finished samples
        of an unfinished request carry their finish reason), to pass as `resume` later.
        """
        if self.has_unfinished():
            raise RuntimeError("generate_partial() needs an idle engine")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids: Sequence[str | None] = request_ids or [None] * len(prompts)
        keys: Sequence[str | None] = prompt_keys or [None] * len(prompts)
        self.reset_timeline()
        controller = self.controller
        if controller is not None:
            controller.stats.reset_s += self.settle_layout()
            controller.begin(quota)
        self.import_requests(resume)
        for p, sp, rid, key in zip(prompts, params, ids, keys, strict=True):
            self.add_request(p, sp, request_id=rid, prompt_key=key)
        if controller is not None:
            finished = list(controller.run(self).values())
        else:
            finished = []
            while self.has_unfinished() and len(finished) < quota:
                finished += self.step()
        rest = self.export_requests(self.request_ids(), with_kv=False, include_finished=True)
        if controller is not None:
            controller.end(self)
        return finished, rest

    # -------------------------------------------------------- move requests

    def export_requests(
        self, request_ids: Iterable[str], with_kv: bool = True, include_finished: bool = False
    ) -> list[SequenceState]:
        """Take unfinished requests out of this engine, to continue elsewhere. With
        `include_finished`, their already finished samples come along (with finish reason),
        so the request is whole wherever it is imported."""
        states: list[SequenceState] = []
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                raise KeyError(f"no request {request_id!r} in this engine")
            exported: set[int] = set()  # a leader exports the children waiting on its prefill
            for index in sorted(request.seqs):
                seq = request.seqs[index]
                if seq.seq_id in exported:
                    continue
                if seq.is_finished:
                    if include_finished:
                        states.append(self._state(seq, None))
                    continue
                kv = None
                if with_kv and seq.status is SequenceStatus.RUNNING and not seq.fork_children:
                    kv = self.cache.export(seq.seq_id)
                pending_children = seq.fork_children
                seq.fork_children = []
                self.scheduler.remove(seq)
                for s in (seq, *pending_children):
                    states.append(self._state(s, kv if s is seq else None))
                    exported.add(s.seq_id)
        return states

    def snapshot_requests(self, request_ids: Iterable[str]) -> list[SequenceState]:
        """The samples of these requests as they stand, finished ones included, without KV,
        leaving the engine as it was: a report from which another replica can continue them
        by recompute (import_requests) if this one is lost."""
        states: list[SequenceState] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                raise KeyError(f"no request {request_id!r} in this engine")
            states += [self._state(request.seqs[i], None) for i in sorted(request.seqs)]
        return states

    def _state(self, seq: Seq, kv: Any) -> SequenceState:
        return SequenceState(
            request_id=seq.request_id,
            sample_index=seq.sample_index,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            output_logprobs=list(seq.output_logprobs),
            params=seq.params,
            generator_state=export_generator(seq.generator),
            output_top_logprobs=list(seq.output_top_logprobs),
            kv=kv,
            num_preemptions=seq.num_preemptions,
            finish_reason=seq.finish_reason if seq.is_finished else None,
        )

    def import_requests(self, states: Iterable[SequenceState]) -> None:
        """Continue exported samples here: with their KV when it fits, else by recompute.
        Samples that had not started (exported before their prompt's prefill) wait on one
        leader again, so the prompt is prefilled once and forked, as for a fresh request."""
        leaders: dict[str, Seq] = {}
        for st in states:
            request = self._requests.get(st.request_id)
            if request is None:
                request = self._requests[st.request_id] = _Request(
                    st.request_id, list(st.prompt_token_ids)
                )
            if st.sample_index in request.seqs:
                raise ValueError(
                    f"sample {st.sample_index} of request {st.request_id!r} is already here"
                )
            seq = Seq(
                next(self._seq_ids),
                st.request_id,
                st.sample_index,
                list(st.prompt_token_ids),
                st.params,
                import_generator(st.generator_state),
                output_token_ids=list(st.output_token_ids),
                output_logprobs=list(st.output_logprobs),
                output_top_logprobs=list(st.output_top_logprobs),
                num_preemptions=st.num_preemptions,
            )
            request.seqs[st.sample_index] = seq
            if st.finish_reason is not None:
                seq.finish(st.finish_reason)  # a finished sample of a request that goes on
                continue
            if not st.output_token_ids and st.kv is None:
                leader = leaders.get(st.request_id)
                if leader is not None:
                    leader.fork_children.append(seq)
                    continue
                leaders[st.request_id] = seq
            if st.kv is not None and self._kv_matches(seq, st) and self.cache.can_import(st.kv):
                self.cache.import_(seq.seq_id, st.kv)
                if self.cache.blocks.num_uncomputed(seq.seq_id) == 0:
                    seq.status = SequenceStatus.RUNNING
                    self.scheduler.running.append(seq)
                    continue
                self.scheduler.remove(seq)  # KV short of the last token: recompute instead
            self.scheduler.add(seq)

    @staticmethod
    def _kv_matches(seq: Seq, st: SequenceState) -> bool:
        assert st.kv is not None
        return list(st.kv.token_ids) == seq.token_ids[:-1] and seq.output_token_ids != []

    # ----------------------------------------------------------- reconfigure

    def reconfigure(
        self, target: int | ParallelLayout, kv_policy: KVPolicy = "migrate"
    ) -> ReconfigReport:
        """Move to another TP layout mid-generation; every rank of the world calls it at once.

        `target` is a TP size looked up in the engine's GroupCache, or a layout from it.
        Unfinished samples keep their tokens, logprobs and generator states; their KV is
        migrated or recomputed as `kv_policy` says (see patrl.rollout.reconfigure). Bad targets
        raise before anything changes.
        """
        dst = self._target_layout(target)
        check_target(self, dst)
        self._return_to = None  # an explicit move supersedes a deferred return
        self.reconfiguring = True
        try:
            return reconfigure(self, dst, kv_policy)
        finally:
            self.reconfiguring = False

    def migrate_requests(
        self, request_ids: Sequence[str], src_dp: int, dst_dp: int, with_kv: bool = True
    ) -> int:
        """Cut-and-migrate requests between replicas at this layout (patrl.rollout.migrate)."""
        return cut_and_migrate(self, request_ids, src_dp, dst_dp, with_kv)

    def _target_layout(self, target: int | ParallelLayout) -> ParallelLayout:
        self.model.config.check_tp(target.tp_size if isinstance(target, ParallelLayout) else target)
        if isinstance(target, ParallelLayout):
            if self.groups is not None and target != self.groups.layout(target.tp_size):
                raise ValueError(
                    f"layout with tp_size={target.tp_size} is not this engine's GroupCache "
                    "layout: pass a TP size or groups.layout(tp)"
                )
            return target
        if self.groups is None:
            raise ValueError(
                f"reconfigure({target}) needs the engine's GroupCache: Engine(..., groups=...)"
            )
        return self.groups.layout(target)

    def request_ids(self) -> list[str]:
        """Unfinished requests, in arrival order."""
        return [r for r, req in self._requests.items() if not req.done()]

    def unfinished_seqs(self) -> list[Seq]:
        return [s for r in self._requests.values() for s in r.seqs.values() if not s.is_finished]

    def next_request_number(self) -> int:
        n = next(self._request_ids)
        self._request_ids = itertools.count(n)
        return n

    def next_seq_id(self) -> int:
        n = next(self._seq_ids)
        self._seq_ids = itertools.count(n)
        return n

    def rebuild(self, layout: ParallelLayout, next_seq_id: int, next_request: int = 0) -> None:
        """An empty KV cache and scheduler for `layout` (the weights are already re-cut);
        counters continue from the largest of the ranks that now form one replica."""
        self.layout = layout
        self._request_ids = itertools.count(max(next_request, self.next_request_number()))
        preemptions = self.scheduler.num_preemptions
        # Every sequence has left the old cache (exported) by now: its pool is dead storage.
        self.cache = self._build_cache(reuse=self.cache)
        self.scheduler = Scheduler(
            self.cache.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.scheduler.num_preemptions = preemptions
        self._seq_ids = itertools.count(next_seq_id)

    # --------------------------------------------------------------- weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full tensors under their HF names (cut for this layout); cached prefixes are
        dropped because their KV came from the old weights.

        After an adaptive rollout the engine owes a return to its starting layout; the load
        pays it for free (no gather, no collective): from the full tensors the fold kept when
        there are some (then loaded in place, as at any layout), else by rebuilding the model
        at that layout from these tensors, which must then be every weight (a partial load
        raises and changes nothing)."""
        if self._return_to is not None and not self.has_unfinished():
            self._load_at(self._return_to, named_tensors)
        else:
            load_weights(self.model, named_tensors)
        self.weight_version = version
        self.cache.blocks.reset_prefix_cache()

    def return_later(self, layout: ParallelLayout) -> None:
        """Go back to `layout` at the next full `load_weights`, or else at the next adaptive
        rollout (by a reconfigure); until then the engine works on at its current layout."""
        self._return_to = None if layout == self.layout else layout

    def settle_layout(self) -> float:
        """Pay a return owed by `return_later` now (every rank at once); seconds it took."""
        if self._return_to is None:
            return 0.0
        start = time.perf_counter()
        target, self._return_to = self._return_to, None
        self.reconfigure(target, "recompute")
        return time.perf_counter() - start

    def _load_at(
        self, layout: ParallelLayout, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        start = time.perf_counter()
        restored = layout.tp_size == 1 and restore_full_(self.model, layout) is not None
        if not restored:
            self.model = self._built_at(layout, named_tensors)
        # at `layout` from here on, whatever the load below does (as a load at any layout, one
        # that raises midway leaves the weights it loaded)
        self.rebuild(layout, self.next_seq_id(), self.next_request_number())
        self._return_to = None
        if restored:
            load_weights(self.model, named_tensors)  # into the kept full tensors, in place
        if self.controller is not None:
            self.controller.stats.reset_s += time.perf_counter() - start

    def _built_at(
        self, layout: ParallelLayout, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> CausalLM:
        """A new model at `layout` from every weight; raises, the engine unchanged, on fewer."""
        current = self.model
        model = build_model(
            current.config,
            layout,
            attention=self.config.attention_backend,
            dtype=next(current.parameters()).dtype,
            device=self.device,
        )
        missing = weight_keys(model) - load_weights(model, named_tensors)
        if missing:
            raise ValueError(
                f"load_weights brought {len(missing)} fewer weights than the model has (e.g. "
                f"{sorted(missing)[:3]}); after an adaptive rollout it must bring all of them, "
                f"as it rebuilds the model at tp={layout.tp_size}; the engine is unchanged"
            )
        return model

    # ----------------------------------------------------------------- stats

    def tokens_per_s(self) -> float:
        c = self.counters
        return c.generated_tokens / c.busy_s if c.busy_s else 0.0

    def stats(self) -> dict[str, Any]:
        """Counters, plus the latest rollout's step timeline and (adaptive TP) every planner
        decision with its prediction and measured outcome."""
        blocks, c = self.cache.blocks, self.counters
        adaptive: dict[str, Any] = {}
        if self.controller is not None:
            adaptive = {
                **self.controller.stats.as_dict(),
                "tp_decisions": [d.to_dict() for d in self.controller.decisions],
            }
        return {
            **adaptive,
            "tp_size": self.layout.tp_size,
            "timeline": [dataclasses.asdict(r) for r in self.timeline],
            "running": self.scheduler.num_running_samples(),
            "waiting": sum(s.group_size for s in self.scheduler.waiting)
            + (self.scheduler.prefilling.group_size if self.scheduler.prefilling else 0),
            "kv_blocks_used": blocks.num_used_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "prefix_hit_rate": blocks.prefix_hit_rate(),
            "num_preemptions": self.scheduler.num_preemptions,
            "steps": c.steps,
            "prefill_tokens": c.prefill_tokens,
            "decode_tokens": c.decode_tokens,
            "generated_tokens": c.generated_tokens,
            "tokens_per_s": self.tokens_per_s(),
            "weight_version": self.weight_version,
        }


def _maybe_tokenizer(model_dir: str) -> Any:
    try:
        return read_tokenizer(model_dir)
    except (OSError, ValueError, TypeError):
        return None  # a weights-only directory (tests, exported checkpoints): ids in, ids out


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
