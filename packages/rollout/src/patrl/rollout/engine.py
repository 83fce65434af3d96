"""The generation engine of one rollout replica at one layout: requests in, completions out.

Used as a library, it reads as vLLM's `LLM` does::

    from patrl.rollout import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model="path/to/hf_model_dir"))
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128, stop=["Q:"], seed=0)
    for out in engine.generate(["The capital of France is"], params):
        print(out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason)
    chat = engine.chat([{"role": "user", "content": "What is 2 + 2?"}], params)

Prompts are text (encoded without special tokens) or token ids; each output carries its
token ids, their logprobs, text and finish reason. For tensor parallelism launch the script
with `torchrun --nproc_per_node 2` and pass `tp_policy=StaticTP(tp=2)`: every rank builds the
engine and makes the same calls, and gets the same outputs (patrl.rollout.torchrun).

One `Engine` runs on one TP group. Every rank of the group holds the same scheduler state and
makes the same scheduling decisions (the scheduler is deterministic), and samples the same
tokens (`ModelRunner` checks it). Changing the layout while generating is adaptive TP's job
(`patrl.rollout.adaptive`), which drives an engine from outside; see docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from patrl.kvstore import PagedKVCache
from patrl.rollout.config import EngineConfig
from patrl.rollout.loader import read_eos_token_ids, read_tokenizer_if_any
from patrl.rollout.model_runner import ModelRunner
from patrl.rollout.models.causal_lm import CausalLM
from patrl.rollout.outputs import RequestOutput, SequenceState, request_output
from patrl.rollout.records import EngineCounters, StepRecord
from patrl.rollout.request_input import (
    Conversation,
    check_batch,
    check_params,
    encode,
    progress_bar,
    reject_reason,
    render_chat,
)
from patrl.rollout.sampler import SampleOutput, SamplingParams, make_generator
from patrl.rollout.scheduler import Scheduler
from patrl.rollout.sequence import Request
from patrl.rollout.sequence import Sequence as Seq
from patrl.rollout.torchrun import torchrun_groups
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.rollout.transfer import export_requests, import_requests, snapshot_requests
from patrl.tpreshard import GroupCache, ParallelLayout, single_process_layout, tp_broadcast


class Engine:
    """One rollout replica at one TP layout: continuous batching over a paged KV cache, with
    vLLM's request API. `generate` / `chat` run a batch to completion; `add_request`, `step`
    and `abort` drive it a step at a time; `export_requests` / `import_requests` move
    unfinished samples to another engine; `load_weights` swaps the policy's weights (RL).

    Invariants: every rank of the TP group makes the same calls in the same order (SPMD) and
    gets the same outputs; a request's tokens depend on its prompt, params and seed only, not
    on its batch, the layout or the device. Outputs come back as `RequestOutput`s, their
    samples as `CompletionOutput`s (see patrl.rollout.outputs)."""

    def __init__(
        self,
        config: EngineConfig,
        layout: ParallelLayout | None = None,
        groups: GroupCache | None = None,
    ) -> None:
        """`layout`: this rank's TP group (default: one process, or, for
        `StaticTP(tp=N)` with N > 1, this rank's group of N from `groups`, made over
        torchrun's world when not given; see patrl.rollout.torchrun). `groups`: the
        GroupCache the layout comes from, where other layouts may be looked up (reconfigure).
        Every rank of the world builds its engine at once."""
        policy = config.tp_policy
        if isinstance(policy, AdaptiveTP):
            raise ValueError(
                "Engine runs one layout; for tp_policy adaptive use "
                "patrl.rollout.make_engine(config, ...) or AdaptiveEngine(config, ...)"
            )
        if layout is None and policy.tp is not None and policy.tp > 1:
            if groups is None:
                groups = torchrun_groups([policy.tp], config, f"StaticTP(tp={policy.tp})")
            layout = groups.layout(policy.tp)
        if policy.tp is not None and (layout.tp_size if layout else 1) != policy.tp:
            raise ValueError(
                f"tp_policy static tp={policy.tp} but the engine's layout has "
                f"tp_size={layout.tp_size if layout else 1}"
            )
        self.config = config
        self.groups = groups
        self.runner = ModelRunner(config, layout or single_process_layout(), groups)
        self.max_model_len = self.runner.max_model_len
        self.tokenizer = read_tokenizer_if_any(config.model)
        self.eos_token_ids = frozenset(read_eos_token_ids(config.model))
        self.scheduler = self._new_scheduler()
        self.weight_version = 0
        self.counters = EngineCounters()
        self._requests: dict[str, Request] = {}
        self.timeline: list[StepRecord] = []  # steps of the latest `generate` call
        self._timeline_start = time.perf_counter()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    @property
    def layout(self) -> ParallelLayout:
        """This rank's TP group and place in the data-parallel world."""
        return self.runner.layout

    @property
    def model(self) -> CausalLM:
        """The model, its weights cut for `layout`."""
        return self.runner.model

    @property
    def cache(self) -> PagedKVCache:
        """This rank's KV cache (its blocks hold this rank's KV heads)."""
        return self.runner.cache

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.runner.cache.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens
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

        `prompt` is token ids, or text encoded with the model's tokenizer (no special tokens
        added: a chat template or the caller adds them). A request that cannot run (empty, too
        long, token ids outside the vocabulary) finishes at the next `step` with finish_reason
        "rejected" and the reason in its `error`; params it cannot honour raise ValueError
        before anything is queued. Generated ids are unique across the world's replicas.
        `prompt_key` names the prompt for a driver that learns lengths (adaptive TP); the
        engine does not use it."""
        params = params or SamplingParams()
        self.check_params(params)
        if request_id is None:
            request_id = f"req-{self._group_rank()}-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.seed is None and params.temperature > 0 and self.layout.tp_size > 1:
            # The TP group samples as one replica: its ranks draw one stream, seeded by the first
            # rank (OS-random: torch's global generator is the trainer's; on the device for NCCL)
            drawn = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=self.device)
            params = dataclasses.replace(
                params, seed=int(tp_broadcast(self.layout, drawn, src=0).item())
            )
        token_ids = encode(prompt, self.tokenizer, self.config.model)
        request = self._requests[request_id] = Request(request_id, token_ids)
        seqs = [self._new_seq(request_id, i, token_ids, params) for i in range(params.n)]
        request.seqs = {s.sample_index: s for s in seqs}
        vocab = self.model.config.vocab_size
        request.error = reject_reason(token_ids, self.max_model_len, vocab)
        if request.error is not None:
            for s in seqs:
                s.finish("rejected")
            return request_id
        seqs[0].fork_children = seqs[1:]  # prefilled once, forked when the prefill is done
        self.scheduler.add(seqs[0])
        return request_id

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError, naming the value, for params this engine cannot honour (stop
        strings without a tokenizer, more top logprobs than the vocabulary)."""
        check_params(params, self.tokenizer, self.model.config.vocab_size, self.config.model)

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

    def abort(self, request_id: str) -> None:
        """Stop a request; it is returned by the next `step` with finish_reason "abort"."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        for seq in request.seqs.values():
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        """Whether a request has not been returned by `step` yet."""
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        """Unfinished requests, in arrival order."""
        return [r for r, req in self._requests.items() if not req.done()]

    def unfinished_seqs(self) -> list[Seq]:
        """Every sample still generating or waiting, of every request."""
        return [s for r in self._requests.values() for s in r.seqs.values() if not s.is_finished]

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch (a prefill or a decode step); return the requests that
        finished with it, each once, all of its samples done."""
        batch = self.scheduler.schedule()
        if batch is not None:
            start = time.perf_counter()
            sampled = self.runner.run(batch)
            self.counters.count_step(batch.is_prefill, batch.num_tokens)
            if sampled is not None:
                if batch.is_prefill:
                    for i in sampled.ready:
                        self._end_prefill(batch.seqs[i])
                self._postprocess(sampled.samplers, sampled.out)
            end = time.perf_counter()
            self.counters.busy_s += end - start
            running = self.scheduler.num_running_samples()
            self.timeline.append(
                StepRecord(
                    start - self._timeline_start,
                    end - start,
                    running,
                    batch.num_tokens,
                    batch.is_prefill,
                    self.layout.tp_size,
                )
            )
        return self._collect_finished()

    def reset_timeline(self) -> None:
        """Start `timeline` afresh (each `generate` does), its clock at zero now."""
        self.timeline = []
        self._timeline_start = time.perf_counter()

    def _end_prefill(self, leader: Seq) -> None:
        if leader.fork_children:
            children = [c.seq_id for c in leader.fork_children]
            self.runner.cache.blocks.fork(leader.seq_id, children)
        self.scheduler.finish_prefill(leader)

    def _postprocess(self, seqs: list[Seq], out: SampleOutput) -> None:
        host = out.to_host()  # the step's one copy to the host
        for row, seq in enumerate(seqs):
            top = host.top(row, seq.params.logprobs)
            seq.append_token(host.tokens[row], host.logprobs[row], top)
            seq.weight_version = self.weight_version
            self.counters.generated_tokens += 1
            reason = seq.check_stop(self.eos_token_ids, self.max_model_len, self.tokenizer)
            if reason is not None:
                self.scheduler.finish(seq, reason)

    def _collect_finished(self) -> list[RequestOutput]:
        done = [r for r in self._requests.values() if r.done()]
        for r in done:
            del self._requests[r.request_id]
        return [request_output(r, self.tokenizer) for r in done]

    # -------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        prompt_keys: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of `prompts` (vLLM's
        `LLM.generate`). `params`: one for every prompt, or one each; every one is checked
        before any request is queued. `progress` shows a bar on the group's first rank."""
        params, keys = check_batch(prompts, params, prompt_keys)
        for sp in set(params):
            self.check_params(sp)
        self.reset_timeline()
        ids = [
            self.add_request(p, sp, prompt_key=k)
            for p, sp, k in zip(prompts, params, keys, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(len(ids)) if progress and self.layout.is_tp_first else None
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

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`generate` on conversations (vLLM's `LLM.chat`): `messages` is one conversation
        (a list of {"role": ..., "content": ...}) or a list of them; each is rendered by the
        model's chat template (or `chat_template`), with the assistant's turn opened unless
        `add_generation_prompt` is off, and encoded without adding special tokens. Outputs in
        the order of the conversations. Raises ValueError, naming the model directory, when
        it has no tokenizer or no chat template."""
        prompts = render_chat(
            self.tokenizer,
            self.config.model,
            messages,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
        )
        return self.generate(prompts, params, progress)

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
        their KV recomputed under the current weights), then run `prompts`, until `quota`
        requests have finished. Returns the finished requests and every sample of the
        unfinished ones (finished samples with their finish reason), to pass as `resume`."""
        if self.has_unfinished():
            raise RuntimeError("generate_partial() needs an idle engine")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        self.reset_timeline()
        self.start_partial(prompts, params, request_ids, prompt_keys, resume)
        finished: list[RequestOutput] = []
        while self.has_unfinished() and len(finished) < quota:
            finished += self.step()
        return finished, self.export_requests(self.request_ids(), False, include_finished=True)

    def start_partial(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str] | None,
        prompt_keys: Sequence[str] | None,
        resume: Sequence[SequenceState],
    ) -> list[str]:
        """Queue a partial rollout: `resume` first, then `prompts`; returns the ids of the
        requests added for `prompts`."""
        ids: Sequence[str | None] = request_ids or [None] * len(prompts)
        keys: Sequence[str | None] = prompt_keys or [None] * len(prompts)
        self.import_requests(resume)
        return [
            self.add_request(p, sp, request_id=rid, prompt_key=key)
            for p, sp, rid, key in zip(prompts, params, ids, keys, strict=True)
        ]

    # -------------------------------------------------------- move requests

    def export_requests(
        self, request_ids: Iterable[str], with_kv: bool = True, include_finished: bool = False
    ) -> list[SequenceState]:
        """Take unfinished requests out of this engine, to continue elsewhere. With
        `include_finished`, their finished samples come along (with finish reason)."""
        return export_requests(
            self._requests, self.scheduler, self.cache, request_ids, with_kv, include_finished
        )

    def snapshot_requests(self, request_ids: Iterable[str]) -> list[SequenceState]:
        """The samples of these requests as they stand, without KV, leaving the engine as it
        was: enough for another replica to continue them (by recompute) if this one is lost."""
        return snapshot_requests(self._requests, request_ids)

    def import_requests(self, states: Iterable[SequenceState]) -> None:
        """Continue exported samples here: with their KV when it fits, else by recompute."""
        self.runner.check_awake("import_requests")
        import_requests(
            self._requests, self.scheduler, self.cache, states, lambda: next(self._seq_ids)
        )

    def next_request_number(self) -> int:
        """The number the next generated request id takes (not consumed)."""
        n = next(self._request_ids)
        self._request_ids = itertools.count(n)
        return n

    def next_seq_id(self) -> int:
        """The id the next sequence takes (not consumed)."""
        n = next(self._seq_ids)
        self._seq_ids = itertools.count(n)
        return n

    def advance_ids(self, next_seq_id: int = 0, next_request: int = 0) -> None:
        """Continue sequence and request numbers from at least these (ids stay unique when
        requests of several replicas meet in this engine)."""
        self._seq_ids = itertools.count(max(next_seq_id, self.next_seq_id()))
        self._request_ids = itertools.count(max(next_request, self.next_request_number()))

    def rebuild(self, layout: ParallelLayout, model: CausalLM | None = None) -> None:
        """Start over at `layout`, the model already cut for it (or `model`): a fresh KV
        cache and scheduler. Every unfinished request must have been exported first."""
        preemptions = self.scheduler.num_preemptions
        self.runner.rebuild(layout, model)
        self.scheduler = self._new_scheduler()
        self.scheduler.num_preemptions = preemptions

    # --------------------------------------------------------------- weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full tensors under their HF names, cut for this layout; cached prefixes are
        dropped because their KV came from the old weights."""
        self.runner.load_weights(named_tensors)
        self.weight_version = version
        self.cache.blocks.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 2: also move the weights to host memory) until `wake_up`,
        e.g. while a colocated trainer updates (verl's free_cache_engine). No sequence may
        hold KV; generating while asleep raises. See docs/architecture.md ("Memory")."""
        self.runner.sleep(level)

    def wake_up(self) -> None:
        """Undo `sleep`: the weights back, bit for bit, and an empty KV cache."""
        self.runner.wake_up()

    # ----------------------------------------------------------------- stats

    def tokens_per_s(self) -> float:
        """Tokens sampled per second of `step` time, over the engine's life."""
        c = self.counters
        return c.generated_tokens / c.busy_s if c.busy_s else 0.0

    def stats(self) -> dict[str, Any]:
        """Counters, and the latest rollout's step timeline."""
        blocks, c, sched = self.cache.blocks, self.counters, self.scheduler
        return {
            "tp_size": self.layout.tp_size,
            "timeline": [dataclasses.asdict(r) for r in self.timeline],
            "running": sched.num_running_samples(),
            "waiting": sum(s.group_size for s in sched.waiting)
            + (sched.prefilling.group_size if sched.prefilling else 0),
            "kv_blocks_used": blocks.num_used_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "prefix_hit_rate": blocks.prefix_hit_rate(),
            "num_preemptions": sched.num_preemptions,
            "steps": c.steps,
            "prefill_tokens": c.prefill_tokens,
            "decode_tokens": c.decode_tokens,
            "generated_tokens": c.generated_tokens,
            "tokens_per_s": self.tokens_per_s(),
            "weight_version": self.weight_version,
        }
