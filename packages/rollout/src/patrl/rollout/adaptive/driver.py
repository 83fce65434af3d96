"""Adaptive TP: an engine whose layout a planner changes while it generates (PAT).

`AdaptiveEngine` drives an `Engine` from outside. A rollout is a world collective: every rank
calls `generate` (with its replica's prompts, possibly none). The loop on every rank is
check -> a window of decode steps -> check -> ...; at a check `TPController` turns the
replicas' summaries into a verdict, and on "switch" every rank calls `reconfigure` at once.
A window is the planner's steps of the slowest replica, timed, so each replica steps at its
own pace. After a rollout the engine owes a return to the layout the next one opens at
(`WayBack`): the first check picks it for the whole batch. See docs/adaptive_tp.md.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from patrl.lenpredict import NEVER, Layout
from patrl.rollout.adaptive.controller import Verdict
from patrl.rollout.adaptive.protocols import Lengths, Planner
from patrl.rollout.adaptive.reconfig import reconfigure
from patrl.rollout.adaptive.setup import open_controller
from patrl.rollout.adaptive.switch_plan import Row
from patrl.rollout.adaptive.way_back import WayBack
from patrl.rollout.config import EngineConfig
from patrl.rollout.drafter import Drafter
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import RequestOutput, SequenceState
from patrl.rollout.request_input import Conversation, check_batch, progress_bar, render_chat
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.sequence import SequenceStatus
from patrl.rollout.tp_policy import AdaptiveTP, StaticTP
from patrl.tpreshard import GroupCache, ParallelLayout, gather_objects


def make_engine(
    config: EngineConfig,
    layout: ParallelLayout | None = None,
    groups: GroupCache | None = None,
    planner: Planner | None = None,
    lengths: Lengths | None = None,
) -> Engine | AdaptiveEngine:
    """The engine `config.tp_policy` asks for: an `Engine` (static) or an `AdaptiveEngine`.
    Every rank of the world calls it at once; without `layout` and `groups` under torchrun,
    the engine joins the world and makes its groups itself (patrl.rollout.torchrun).
    `planner` and `lengths` (adaptive only) replace the planner built from the policy's
    profile and the online LengthPredictor."""
    if isinstance(config.tp_policy, AdaptiveTP):
        return AdaptiveEngine(config, layout, groups, planner, lengths)
    return Engine(config, layout, groups)


class AdaptiveEngine:
    """An engine under `tp_policy=adaptive`: a `RolloutEngine` (plus `chat`) whose one-layout
    work is done by `self.engine`, the `Engine` it wraps (reach it there for the step-level
    API: `add_request`, `step`, moving requests, the model), while a `TPController` folds the
    world's replicas into larger TP groups as a rollout's batch drains (PAT). `generate`, `chat` and
    `generate_partial` are collectives over the world: every rank calls them, each with its
    own replica's prompts (possibly none), and gets its own prompts' outputs back, whichever
    replica finished them. Sampled tokens do not depend on the switches (each sample keeps
    its generator); see docs/adaptive_tp.md."""

    def __init__(
        self,
        config: EngineConfig,
        layout: ParallelLayout | None = None,
        groups: GroupCache | None = None,
        planner: Planner | None = None,
        lengths: Lengths | None = None,
    ) -> None:
        """Every rank of the world builds its engine at once (the groups are made here when
        not given); it starts at the smallest usable candidate TP size."""
        if not isinstance(config.tp_policy, AdaptiveTP):
            raise ValueError("AdaptiveEngine needs tp_policy adaptive; use Engine for static")
        self.config = config
        start, self.groups, self.controller = open_controller(
            config, layout, groups, planner, lengths
        )
        static = config.model_copy(update={"tp_policy": StaticTP()})
        self.engine = Engine(static, start, self.groups)
        self.way_back = WayBack(self.engine)

    # ------------------------------------------------------- RolloutEngine

    @property
    def layout(self) -> ParallelLayout:
        """The layout the engine is at now (it changes during a rollout)."""
        return self.engine.layout

    @property
    def drafter(self) -> Drafter | None:
        """The engine's drafter (None: speculation off); it outlives folds."""
        return self.engine.drafter

    def sleep(self, level: int = 1) -> None:
        """`Engine.sleep` at the layout the engine is at (a return owed stays owed)."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """`Engine.wake_up`."""
        self.engine.wake_up()

    def stats(self) -> dict[str, Any]:
        """The engine's stats, plus every planner decision of the latest rollout with its
        prediction and measured outcome."""
        if self.controller is None:
            return self.engine.stats()
        return {
            **self.controller.stats.as_dict(),
            "tp_decisions": [d.to_dict() for d in self.controller.decisions],
            **self.engine.stats(),
        }

    # ----------------------------------------------------------- the way back

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """`Engine.load_weights`, paying a return owed after a rollout for free when the
        engine is idle (see `WayBack.load_weights`)."""
        spent = self.way_back.load_weights(named_tensors, version)
        if self.controller is not None:
            self.controller.stats.reset_s += spent

    def return_later(self, layout: ParallelLayout) -> None:
        """Go back to `layout` at the next full `load_weights`, or else at the next rollout."""
        self.way_back.later(layout)

    def settle_layout(self) -> float:
        """Pay a return owed by `return_later` now (every rank at once); seconds it took."""
        return self.way_back.settle()

    # -------------------------------------------------------------- rollouts

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        prompt_keys: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of `prompts`. A collective over
        the world: every rank calls it (with its replica's prompts, possibly none)."""
        controller = self.controller
        if controller is None:
            return self.engine.generate(prompts, params, progress, prompt_keys)
        params, keys = check_batch(prompts, params, prompt_keys, self.engine.check_params)
        self.engine.reset_timeline()
        if self.engine.has_unfinished():
            raise RuntimeError(
                "adaptive generate() needs an idle engine: requests added to its engine "
                "(add_request) are still unfinished"
            )
        controller.stats.reset_s += self.settle_layout()
        controller.begin()
        ids = self._add_replica_requests(prompts, params, keys)
        assert self.groups is not None  # adaptive engines with a controller have a GroupCache
        bar = progress_bar(len(ids)) if progress and self.groups.rank == 0 else None
        results = self._run(on_finished=(lambda _: bar.update(1)) if bar else None)
        if controller.split:
            results = self._hand_back(results, ids)
        self._end(reopen=True)
        if bar is not None:
            bar.close()
        lost = [i for i in ids if i not in results]
        if lost:
            raise RuntimeError(
                f"requests {lost[:5]} were not handed back after the rollout (they finished "
                "on no replica, or on one that did not return them): this is a bug"
            )
        return [results[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        **template: Any,
    ) -> list[RequestOutput]:
        """`Engine.chat`, through this engine's `generate` (a collective over the world)."""
        prompts = render_chat(self.engine.tokenizer, self.config.model, messages, **template)
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
        """`Engine.generate_partial`, until the world has finished the sum of every replica's
        quota; a collective over the world. Ends back at the starting layout (the resumed
        samples belong to their replicas)."""
        controller = self.controller
        if controller is None:
            return self.engine.generate_partial(
                prompts, params, quota, request_ids, prompt_keys, resume
            )
        if self.engine.has_unfinished():
            raise RuntimeError("generate_partial() needs an idle engine")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        self.engine.reset_timeline()
        controller.stats.reset_s += self.settle_layout()
        controller.begin(quota)
        added = self.engine.start_partial(prompts, params, request_ids, prompt_keys, resume)
        keys: Sequence[str | None] = prompt_keys or [None] * len(prompts)
        for rid, key, sp in zip(added, keys, params, strict=True):
            controller.note_request(rid, key or rid, sp.n)
        finished = list(self._run().values())
        engine = self.engine
        rest = engine.export_requests(engine.request_ids(), with_kv=False, include_finished=True)
        self._end()
        return finished, rest

    def _add_replica_requests(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        keys: Sequence[str | None],
    ) -> list[str]:
        """Queue this rank's requests at the start of a rollout; returns their ids. Opened at
        TP>1 the group is one replica: every rank's requests are gathered in TP-rank order
        and queued on every rank of it, as a switch at the first check would have merged
        them; ids and missing seeds come from the submitting rank, so the group's ranks hold
        the same requests and generator streams."""
        layout = self.layout
        if layout.tp_size == 1:
            return [
                self._add_request(p, sp, prompt_key=k)
                for p, sp, k in zip(prompts, params, keys, strict=True)
            ]
        assert self.groups is not None
        first = self.engine.next_request_number()
        mine = []
        for j, (p, sp, k) in enumerate(zip(prompts, params, keys, strict=True)):
            if sp.seed is None:
                sp = dataclasses.replace(sp, seed=secrets.randbits(62))
            mine.append((p, sp, k, f"req-{self.groups.rank}-{first + j}"))
        self.engine.advance_ids(next_request=first + len(mine))
        offer = (mine, self.engine.next_seq_id())
        gathered = gather_objects(layout.tp_comm, layout.tp_group, offer)
        self.engine.advance_ids(next_seq_id=max(g[1] for g in gathered))
        for part, _ in gathered:
            for p, sp, k, rid in part:
                self._add_request(p, sp, request_id=rid, prompt_key=k)
        return [m[3] for m in mine]

    def _add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_key: str | None = None,
    ) -> str:
        """`Engine.add_request` within a rollout: the controller learns the request's length
        group from `prompt_key` (the same key in later rollouts: its history)."""
        request_id = self.engine.add_request(prompt, params, request_id, prompt_key)
        if self.controller is not None and self.controller.in_rollout:
            self.controller.note_request(request_id, prompt_key or request_id, params.n)
        return request_id

    def _run(
        self, on_finished: Callable[[RequestOutput], Any] | None = None
    ) -> dict[str, RequestOutput]:
        """Step the engine, checking and applying verdicts, until no rank has unfinished work
        or the quota is met; returns what finished here."""
        c, engine = self.controller, self.engine
        assert c is not None
        results: dict[str, RequestOutput] = {}
        started = time.perf_counter()  # the requests are queued: a static rollout does it too
        stepping = 0.0  # in engine.step (scheduling included: a static rollout pays it too)
        switching_before = c.stats.reconfig_s
        steps_left, deadline, stepped, opened = 0, math.inf, False, False
        here = Layout.of(engine.layout)
        if not c.partial and c.never_switches(here, engine.max_model_len):
            # no check could ever switch from here: none until this rank is done (the last
            # one, which ends the rollout everywhere and feeds the length model, stays)
            steps_left, opened = NEVER, True
        while True:
            due = steps_left <= 0 or not engine.has_unfinished()
            if not due and stepped and deadline < math.inf:
                # the window is over when the next step would end more than half of it late
                due = time.perf_counter() + 0.5 * (c.step_s or 0.0) >= deadline
            if due:
                rows = unfinished_rows(engine) if engine.layout.tp_rank == 0 else None
                verdict = c.check(rows, engine.layout.tp_size, had_work=engine.has_unfinished())
                if verdict.target_tp is None:
                    break
                if verdict.target_tp != engine.layout.tp_size:
                    self.switch(verdict)
                if not opened:  # the first check saw the whole batch
                    opened = True
                    c.opening_tp = verdict.opening_tp or engine.layout.tp_size
                steps_left = verdict.recheck_steps or c.policy.check_every
                deadline, stepped = math.inf, False
                if verdict.window_s is not None:
                    deadline, steps_left = time.perf_counter() + verdict.window_s, NEVER
                if not engine.has_unfinished():
                    continue
            t0 = time.perf_counter()
            finished = engine.step()
            stepping += time.perf_counter() - t0
            for out in finished:
                results[out.request_id] = out
                if engine.layout.tp_rank == 0:  # the group's first rank reports for it
                    c.note_finished(out)
                if on_finished is not None:
                    on_finished(out)
            if engine.timeline and not engine.timeline[-1].is_prefill:
                steps_left -= 1
                stepped = True
                c.note_decode_step(engine.timeline[-1].duration_s)
        switching = c.stats.reconfig_s - switching_before
        c.end_rollout(stepping, time.perf_counter() - started - switching)
        return results

    def switch(self, verdict: Verdict) -> None:
        """Apply a verdict's switch (every rank at once): `reconfigure` runs the plan the
        planner priced."""
        c = self.controller
        assert c is not None and verdict.target_tp is not None
        self.way_back.owed = None  # an explicit move supersedes a deferred return
        t0 = time.perf_counter()
        reconfigure(self.engine, verdict.target_tp, plan=verdict.plan)
        c.note_switch(verdict, time.perf_counter() - t0)

    def _hand_back(
        self, results: dict[str, RequestOutput], ids: list[str]
    ) -> dict[str, RequestOutput]:
        """After a rollout that split, a request may have finished on another replica than
        its submitter's: every rank sends the outputs it holds of requests it did not submit,
        and keeps those of its own `ids` it lacked (one world all-gather)."""
        c = self.controller
        assert c is not None
        if c.world is None:
            return results
        mine = set(ids)
        offer = {i: out for i, out in results.items() if i not in mine}
        for part in gather_objects(c.comm, c.world, offer):
            for i in mine.intersection(part):
                results.setdefault(i, part[i])
        return results

    def _end(self, reopen: bool = False) -> None:
        """Owe the return to the starting layout or, with `reopen` (`generate`, which can
        merge replicas' submissions), to the layout this rollout's first check chose."""
        c = self.controller
        assert c is not None and self.groups is not None
        tp = c.opening_tp if reopen else c.policy.start_tp
        self.way_back.later(self.groups.layout(tp))


def unfinished_rows(engine: Engine) -> list[Row]:
    """This replica's unfinished samples, as a check's summary reports them."""
    return [
        Row(
            s.request_id,
            s.sample_index,
            s.num_tokens,
            len(s.output_token_ids),
            s.params.max_tokens,
            s.status is SequenceStatus.RUNNING,
            s.prompt_hash,
        )
        for s in engine.unfinished_seqs()
    ]
