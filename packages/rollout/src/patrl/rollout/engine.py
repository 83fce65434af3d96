"""The generation engine of one rollout replica at one layout: requests in, completions out.

Used as a library, it reads as vLLM's `LLM` does::

    from patrl.rollout import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model="path/to/hf_model_dir"))
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128, stop=["Q:"], seed=0)
    for out in engine.generate(["The capital of France is"], params):
        print(out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason)
    chat = engine.chat([{"role": "user", "content": "What is 2 + 2?"}], params)

For tensor parallelism, launch the script with `torchrun --nproc_per_node 2` and pass
`tp_policy=StaticTP(tp=2)` (patrl.rollout.torchrun). One `Engine` runs on one TP group: every
rank of it makes the same calls, holds the same scheduler state, makes the same scheduling
decisions (the scheduler is deterministic) and samples the same tokens (`ModelRunner` checks
it). Changing the layout while generating is adaptive TP's job (`patrl.rollout.adaptive`),
which drives an engine from outside; see docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from patrl.kvstore import PagedKVCache
from patrl.rollout.config import EngineConfig
from patrl.rollout.drafter import draft_totals
from patrl.rollout.kept import KeptTurns
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
    with_group_seed,
)
from patrl.rollout.sampler import SampleOutput, SamplingParams
from patrl.rollout.scheduler import ScheduledBatch, Scheduler
from patrl.rollout.sequence import IdCounter, Request, Seq, new_request
from patrl.rollout.spec_cost import drafter_for
from patrl.rollout.torchrun import static_layout
from patrl.rollout.transfer import export_requests, import_requests, snapshot_requests
from patrl.tpreshard import GroupCache, ParallelLayout, single_process_layout


class Engine(KeptTurns):
    """One rollout replica at one TP layout: continuous batching over a paged KV cache with
    vLLM's request API. `generate` / `chat` run a batch to completion (`RequestOutput`s);
    `add_request` / `step` / `abort` drive it a step at a time; `export_requests` /
    `import_requests` move unfinished samples between engines; `load_weights` takes new
    weights (RL). The TP group's ranks make the same calls in the same order (SPMD) and get
    the same outputs; a request's tokens depend on its prompt, params and seed only."""

    def __init__(
        self,
        config: EngineConfig,
        layout: ParallelLayout | None = None,
        groups: GroupCache | None = None,
    ) -> None:
        """`layout`: this rank's TP group (default: one process, or StaticTP(tp=N)'s group, made
        over torchrun's world if need be: `static_layout`); `groups`: the GroupCache it comes
        from, for other layouts (reconfigure). Every rank builds its engine at once."""
        layout, groups = static_layout(config, layout, groups)
        self.config, self.groups = config, groups
        self.runner = ModelRunner(config, layout or single_process_layout(), groups)
        self.max_model_len, mc = self.runner.max_model_len, self.model.config
        self.tokenizer = read_tokenizer_if_any(config.model)
        self.eos_token_ids = frozenset(read_eos_token_ids(config.model))
        self.drafter = drafter_for(config.speculative, self.model, self.layout.tp_size, mc)
        self.scheduler = self._new_scheduler()
        self.weight_version = 0
        self.counters = EngineCounters()
        self._requests: dict[str, Request] = {}
        self.timeline: list[StepRecord] = []  # steps of the latest `generate` call
        self._timeline_start = time.perf_counter()
        self._seq_ids, self._request_ids = IdCounter(), IdCounter()

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
        c = self.config
        args = (c.max_num_seqs, c.max_num_batched_tokens, self.drafter, self.max_model_len)
        return Scheduler(self.runner.cache.blocks, *args)

    # ------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_key: str | None = None,
        keep: bool = False,
    ) -> str:
        """Queue a request of `params.n` samples; returns its id.

        `prompt`: token ids, or text (encoded adding no special tokens). A request that cannot
        run (empty, too long, ids outside the vocabulary) finishes at the next `step` with
        finish_reason "rejected" and the reason in its `error`; params the engine cannot
        honour raise ValueError. Generated ids are unique across the world's replicas.
        `prompt_key` names the prompt (to learn lengths, adaptive TP; to share drafts).
        `keep`: a sample that completes keeps its KV for `continue_request` (`KeptTurns`)."""
        params = params or SamplingParams()
        self.check_params(params)
        if request_id is None:
            request_id = f"req-{self._group_rank()}-{self._request_ids.take()}"
        if request_id in self._requests or request_id in self.kept_request_ids():
            raise ValueError(f"request id {request_id!r} is already in use")
        params = with_group_seed(params, self.layout, self.device)
        token_ids = encode(prompt, self.tokenizer, self.config.model)
        request = new_request(request_id, token_ids, params, self._seq_ids, prompt_key, keep)
        self._requests[request_id] = request
        seqs = list(request.seqs.values())
        request.error = reject_reason(token_ids, self.max_model_len, self.model.config.vocab_size)
        if request.error is not None:
            for s in seqs:
                s.finish("rejected")
            return request_id
        seqs[0].fork_children = seqs[1:]  # prefilled once, forked when the prefill is done
        self.scheduler.add(seqs[0])
        return request_id

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError naming the value for params this engine cannot honour."""
        check_params(params, self.tokenizer, self.model.config.vocab_size, self.config.model)

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
            counted = draft_totals(self.drafter)
            start = time.perf_counter()
            sampled = self.runner.run(batch)
            self.counters.count_step(batch.is_prefill, batch.num_tokens)
            if sampled is not None:
                if batch.is_prefill:
                    for i in sampled.ready:
                        self._end_prefill(batch.seqs[i])
                self._postprocess(sampled.samplers, sampled.out, batch)
            end = time.perf_counter()
            self.counters.busy_s += end - start
            running = self.scheduler.num_running_samples()
            drafted, accepted = draft_totals(self.drafter, since=counted)
            record = StepRecord(
                start - self._timeline_start, end - start, running, batch.num_tokens,
                batch.is_prefill, self.layout.tp_size, drafted, accepted,
            )  # fmt: skip
            self.timeline.append(record)
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

    def _postprocess(self, seqs: list[Seq], out: SampleOutput, batch: ScheduledBatch) -> None:
        host = out.to_host()  # the step's one copy to the host
        runs = host.runs([d.tokens for d in batch.drafts], len(seqs))
        for i, (seq, rows) in enumerate(zip(seqs, runs, strict=True)):
            n, why = seq.emit(host, rows, self.eos_token_ids, self.max_model_len, self.tokenizer)
            seq.weight_version = self.weight_version
            self.counters.generated_tokens += n
            self.scheduler.settle(seq, n, why, None if batch.is_prefill else batch.drafts[i])

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
        params, keys = check_batch(prompts, params, prompt_keys, self.check_params)
        self.reset_timeline()
        ids = [
            self.add_request(p, sp, prompt_key=k)
            for p, sp, k in zip(prompts, params, keys, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(len(ids), progress and self.layout.is_tp_first)
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
                bar.update(1)
            if not bar.disable:
                running, tok_s = self.scheduler.num_running_samples(), self.tokens_per_s()
                bar.set_postfix(running=running, tok_s=f"{tok_s:.0f}")
        bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        **template: Any,
    ) -> list[RequestOutput]:
        """`generate` on conversations (vLLM's `LLM.chat`): one conversation ({"role",
        "content"} dicts) or a list of them, each rendered by the model's chat template with
        the assistant's turn opened; outputs in their order. `template`: vLLM's
        chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs
        (see `render_chat`, which raises naming the model directory without a template)."""
        prompts = render_chat(self.tokenizer, self.config.model, messages, **template)
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
        import_requests(self._requests, self.scheduler, self.cache, states, self._seq_ids.take)

    def next_request_number(self) -> int:
        """The number the next generated request id takes (not consumed)."""
        return self._request_ids.next

    def next_seq_id(self) -> int:
        """The id the next sequence takes (not consumed)."""
        return self._seq_ids.next

    def advance_ids(self, next_seq_id: int = 0, next_request: int = 0) -> None:
        """Continue sequence and request numbers from at least these (ids stay unique when
        requests of several replicas meet in this engine)."""
        self._seq_ids.next = max(next_seq_id, self._seq_ids.next)
        self._request_ids.next = max(next_request, self._request_ids.next)

    def rebuild(self, layout: ParallelLayout, model: CausalLM | None = None) -> None:
        """Start over at `layout`, the model cut for it (or `model`): a fresh KV cache and
        scheduler, drafters made alike in a larger group. Unfinished requests left first."""
        preemptions, kept = self.scheduler.num_preemptions, self.scheduler.kept
        kept.drop_kv(self.cache.blocks)  # the new cache holds none of it
        if self.drafter is not None and layout.tp_size > self.layout.tp_size:
            self.drafter.merge_reset()
        self.runner.rebuild(layout, model)
        self.scheduler = self._new_scheduler()
        self.scheduler.num_preemptions = preemptions
        self.scheduler.kept = kept

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
        return self.counters.tokens_per_s

    def stats(self) -> dict[str, Any]:
        """Queues, KV use and counters, and the latest rollout's step timeline."""
        return {
            "tp_size": self.layout.tp_size,
            "timeline": [dataclasses.asdict(r) for r in self.timeline],
            **self.scheduler.stats(),
            **self.counters.stats(),
            "weight_version": self.weight_version,
        }
