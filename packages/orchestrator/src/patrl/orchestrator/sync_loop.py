"""The synchronous, colocated schedule (GRPO, and PPO/GAE, RLOO, ReMax, ... alike): every rank
generates, then every rank trains.

One step (`SyncSchedule.train_step`): draw `data.train_batch_size` prompts (every rank the same ones) and hand each DP
rollout replica its share, a prompt's `rollout.n` samples kept together; generate (with
`rollout.adaptive_tp` the planner may fold replicas into larger TP groups for the long tail);
score on each replica's first rank; gather every sample on every rank; update the policy
(`step.update_policy`), the engine asleep meanwhile with `rollout.free_cache_engine`; stream
the new weights into the engine. `run.RunLoop` calls it, then `validate`, logs and
checkpoints. Partial
rollouts (APRIL) and dynamic sampling (DAPO) are rounds of the generate-and-score part.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patrl.lenpredict import LengthPredictor, SpeculativeTail, assign_prompts
from patrl.orchestrator.advantages import filter_zero_variance_groups, refill
from patrl.orchestrator.agent.adaptive_agent_loop import AdaptiveMultiTurnRollout
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout, made_tokens
from patrl.orchestrator.agent.tool_guard import ToolFailureGuard
from patrl.orchestrator.build import (
    build_engine,
    critic_config,
    load_data,
    seed_everything,
    starts_from_adapter,
    trainer_config,
)
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.distributed import World, all_gather_objects, broadcast_object
from patrl.orchestrator.drafter_checkpoint import (
    gather_drafter,
    load_drafter,
    save_drafter,
)
from patrl.orchestrator.errors import JobError
from patrl.orchestrator.generations import dump_generations, generation_rows
from patrl.orchestrator.kl_control import (
    build_kl_controller,
    load_kl_state,
    needs_reference,
    save_kl_state,
)
from patrl.orchestrator.learned_reward import build_learned_reward
from patrl.orchestrator.length_log import append_lengths
from patrl.orchestrator.metrics import replica_timelines
from patrl.orchestrator.rewards import FailureGuard, FailureSummary, RewardManager
from patrl.orchestrator.run import (
    RunLoop,
    RunResult,
    find_checkpoint,
    load_run_state,
    run_state,
    validates,
)
from patrl.orchestrator.sampling import (
    GREEDY_BASELINE_SEED_KEY,
    VALIDATION_SEED_KEY,
    sampling_params,
    training_seed_key,
    validation_batches,
)
from patrl.orchestrator.scoring import (
    Sample,
    filter_value,
    merge_reward_metrics,
    overlong_buffer,
    score_outputs,
)
from patrl.orchestrator.step_metrics import (
    PolicyUpdate,
    data_sources,
    step_metrics,
    timed,
    validation_metrics,
)
from patrl.orchestrator.support import check_supported
from patrl.orchestrator.update import update_policy
from patrl.rollout import AdaptiveEngine, Engine, RolloutEngine, SequenceState
from patrl.rollout.adaptive import LengthGroups
from patrl.rollout.drafter import speculation_metrics
from patrl.trainer import Critic, Trainer

PARTIALS_FILE = "partial_rollouts.pt"  # buffered unfinished groups, in each checkpoint


# the drafter's running counts a speculating tail is measured from (`measured_tail`)
SPEC_TOTALS = (
    "spec_sample_steps",
    "spec_emitted_tokens",
    "spec_drafted_tokens",
    "spec_accepted_tokens",
)


def measured_tail(per_rank: list[dict[str, Any]], max_num_seqs: int) -> SpeculativeTail | None:
    """The speculating tail every rank's engine stats (`Engine.stats`, running totals) say
    so far: acceptance and tokens per step of their summed drafter counts
    (`SpeculativeTail.from_metrics`); None when no rank counted a step."""
    summed = {k: sum(float(stats.get(k, 0.0)) for stats in per_rank) for k in SPEC_TOTALS}
    steps, drafted = summed["spec_sample_steps"], summed["spec_drafted_tokens"]
    if not steps:
        return None
    row = {
        "rollout/spec_acceptance": summed["spec_accepted_tokens"] / drafted if drafted else 0.0,
        "rollout/spec_tokens_per_step": summed["spec_emitted_tokens"] / steps,
    }
    return SpeculativeTail.from_metrics([row], max_num_seqs)


@dataclass(slots=True)
class Partial:
    """An unfinished group of a partial rollout, resumed first at the next step: its
    engine's `SequenceState`s, or with `rollout.multi_turn` one entry per sample, its
    `AgentLoopOutput` once it ended, else its `TurnState` (agent.multi_turn)."""

    item: PromptItem
    states: list[Any]


def _made(state: Any) -> int:
    """Tokens a carried sample has sampled so far (a multi-turn one's model tokens)."""
    if isinstance(state, SequenceState):
        return len(state.output_token_ids)
    return made_tokens(state)


class SyncSchedule:
    """The colocated job: every rank holds a rollout engine (one TP group of the world's
    layout) and a shard of the FSDP2 trainer, and takes part in every phase of a step. A
    `run.Schedule`: `run()` drives it through `run.RunLoop`."""

    def __init__(
        self, config: JobConfig, world: World, model_dir: str, train_files: Any, val_files: Any
    ) -> None:
        check_supported(config, world.size)  # preflight's refusals, for callers that skipped it
        self.world = world
        self.is_first = world.is_first
        self.run_dir = config.run_dir
        self.model_dir = model_dir
        seed_everything(config.trainer.seed)
        data = load_data(config, model_dir, train_files, val_files, announce=world.is_first)
        self.config = config = data.config
        self.tokenizer, self.train_set, self.val_set = data.tokenizer, data.train_set, data.val_set
        self.loader = data.loader
        self._items_by_index = {item.index: item for item in self.train_set.items}
        if config.trainer.val_only and self.val_set is None:
            raise JobError(
                "trainer.val_only=true but the job has no validation prompts: set data.val_files"
            )
        # Learns every prompt's response length; all ranks see the same lengths (the adaptive
        # engine all-gathers them as samples finish; else every step's samples are gathered),
        # so all ranks hold the same predictor and derive the same prompt assignment.
        self.predictor = LengthPredictor()
        self.engine: RolloutEngine = build_engine(config, model_dir, world, lengths=self.predictor)
        self.layout = self.engine.layout if world.distributed else None
        controller = self.engine.controller if isinstance(self.engine, AdaptiveEngine) else None
        # an adaptive engine's rollouts are world collectives: every rank generates, even with
        # no prompt of its own
        self._collective = controller is not None
        # the predictor's one writer: the adaptive controller's (it learns during the
        # rollout), else the schedule's own; `_learn_lengths` reports every finished response
        self.length_groups = (
            controller.length_groups if controller else LengthGroups(self.predictor)
        )
        self._predicted: dict[int, float] = {}  # prompt -> expected length at assignment
        # rollout.multi_turn: prompts run through the agent loop on this rank's engine (static
        # TP > 1: the group's first rank runs the loops and tools and drives its peers;
        # adaptive TP: world rank 0 runs every rank's and drives the world)
        self.multi_turn: MultiTurnRollout | None = None
        if config.rollout.multi_turn.enable:
            if isinstance(self.engine, AdaptiveEngine):
                self.multi_turn = AdaptiveMultiTurnRollout(config, self.engine)
            else:
                assert isinstance(self.engine, Engine)
                self.multi_turn = MultiTurnRollout(config, self.engine)
        mesh = self._mesh()
        self.trainer = Trainer(
            trainer_config(config),
            model_dir,
            mesh=mesh,
            device=world.device,
            reference=needs_reference(config),
        )
        # PPO with a critic: on the same ranks and mesh; from the policy's backbone (a new value
        # head) unless critic.model.path names a value model.
        self.critic = (
            Critic(
                critic_config(config),
                config.critic.model.path or model_dir,
                mesh=mesh,
                device=world.device,
            )
            if config.use_critic
            else None
        )
        self.kl_ctrl = build_kl_controller(config.algorithm.kl_ctrl)
        self.rewards = (
            RewardManager(
                [(f.name, f.weight) for f in config.reward.functions],
                num_workers=config.reward.num_workers,
                timeout_s=config.reward.timeout_s,
            )
            if self._scores
            else None
        )
        self.learned = build_learned_reward(config, self.tokenizer, world, self._scores, mesh)
        self.reward_guard = FailureGuard(config.reward.max_failed_steps)
        self.tool_guard = ToolFailureGuard(config.reward.max_failed_steps)  # multi-turn only
        self._failures: list[FailureSummary] = []  # this step's training scorings
        self.partials: dict[str, Partial] = {}  # request id -> unfinished group
        self._stale_tokens: dict[str, int] = {}  # tokens a buffered group made with old weights
        self.rollout_timeline: list[dict[str, Any]] = []
        self._drafter_state: dict[str, Any] | None = None  # gathered by `before_save`
        self.rollout_decisions: list[dict[str, Any]] = []
        self._replica_timelines: list[dict[str, Any]] = []  # every replica's, after the steps
        self.step = 0
        self._validated = -1  # the newest step whose weights were validated
        self._asleep = False  # the update put the engine to sleep (`_free_cache_engine`)
        self.all_lengths: list[int] = []

    def run(self) -> RunResult:
        """Resume, train every step, validate, log and save (`run.RunLoop`)."""
        return RunLoop(self).run()

    def resume(self) -> None:
        """Continue from the checkpoint the `trainer.resume_*` settings name, if any."""
        RunLoop(self).resume()

    @property
    def _scores(self) -> bool:
        """Whether this rank scores the samples it generated (`_shares`): under static TP the
        first rank of each TP group (its peers hold the same requests); under adaptive TP
        every rank (each hands in prompts of its own and gets their outputs back)."""
        return self._first_of_share(gathered=True)

    def _first_of_share(self, gathered: bool) -> bool:
        """Whether this rank scores its share of an engine call (`_shares(gathered)`)."""
        if self.layout is None or (gathered and self._collective):
            return True
        return self.layout.tp_rank == 0

    def _shares(self, gathered: bool) -> tuple[int, int]:
        """(this rank's share, the number of shares) of a batch's prompts. Static TP: one
        share a replica, its TP ranks all hand in the same requests (a TP engine needs them
        on every rank). Adaptive TP, for an engine call that gathers every rank's requests
        into the replica that runs them (`gathered`: `generate`, the multi-turn world run):
        one share a rank, whatever TP the engine opens at (opened at TP 2, a group's two
        ranks hand in two shares, not one twice). Adaptive `generate_partial` queues what
        each rank hands in on its own replica (not `gathered`): one share a replica, as
        static TP."""
        if self.layout is None:
            return (0, 1)
        if gathered and self._collective:
            return (self.world.rank, self.world.size)
        return (self.layout.dp_rank, self.layout.dp_size)

    def _mesh(self) -> Any:
        if not self.world.distributed:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.world.device.type, (self.world.size,))

    # ------------------------------------------------------------------ step

    def train_step(self) -> dict[str, float]:
        """Step `step`, its phases in order; its metrics row."""
        timings: dict[str, float] = {}
        start = time.perf_counter()
        samples, metrics = self.generate_and_score(timings)
        if self.is_first and self.config.trainer.rollout_data_dir:
            rows = generation_rows(samples, self._items_by_index, self.tokenizer, self.step)
            dump_generations(self.config.trainer.rollout_data_dir, self.step, rows)
        if self.config.algorithm.adv_estimator == "remax":
            metrics.update(self._greedy_baselines(samples, timings))
        update = self.update(samples, timings)  # advantages, then the PPO epochs
        with timed(timings, "update_weights"):
            self.sync_weights()
        timings["step"] = time.perf_counter() - start
        self.all_lengths += [len(s.token_ids) for s in samples]
        return step_metrics(self.config, timings, samples, update, self.world.size, metrics)

    train_one_step = train_step  # its name before `run.Schedule`

    def validate(self, final: bool = False) -> dict[int, dict[str, float]]:
        """The validation of the weights of step `step` when it is due (`run.validates`) and
        not done yet, by step; every rank takes part. `final` changes nothing: this schedule
        validates as it goes."""
        if self.val_set is None or self.step <= self._validated:
            return {}
        if not validates(self.config, self.step):
            return {}
        self._validated = self.step
        return {self.step: self._validate()}

    # ------------------------------------------------------------- run state

    def checkpoint_to_resume(self) -> Path | None:
        found = find_checkpoint(self.config, self.is_first) if self.is_first else None
        return broadcast_object(self.world, found)

    def state_dict(self) -> dict[str, Any]:
        return run_state(self.step, self.loader, self.predictor)

    def before_save(self) -> None:
        """Every replica's drafter history, merged, for `save_files` (a collective)."""
        self._drafter_state = gather_drafter(self.engine.drafter, self.world)

    def save_files(self, staging: Path) -> None:
        torch.save(
            {"partials": self.partials, "stale_tokens": self._stale_tokens},
            staging / PARTIALS_FILE,
        )
        save_kl_state(self.kl_ctrl, staging)
        save_drafter(self._drafter_state, staging)

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.step = load_run_state(state, self.loader, self.predictor)
        if (checkpoint / PARTIALS_FILE).is_file():
            saved = torch.load(checkpoint / PARTIALS_FILE, weights_only=False)
            self.partials, self._stale_tokens = saved["partials"], saved["stale_tokens"]
        load_kl_state(self.kl_ctrl, checkpoint)
        load_drafter(
            self.engine.drafter,
            checkpoint,
            self.world.rank,
            self.world.size,
            self.engine.layout.tp_size,
        )

    def begin(self) -> None:
        """A resumed run's weights into the engine (nothing was validated since), or a fresh
        run's when its policy is not the engine's (LoRA from `model.lora_adapter_path`)."""
        if self.step > 0:
            self.sync_weights()
            self._validated = self.step
        elif starts_from_adapter(self.config):
            self.sync_weights()

    def end(self) -> None:
        """Every replica's last training rollout, for the plots (a collective: every rank,
        with `trainer.plots`)."""
        if self.config.trainer.plots:
            gathered = all_gather_objects(self.world, self._rank_timeline())
            self._replica_timelines = replica_timelines(gathered)

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()

    def timelines(self) -> list[dict[str, Any]]:
        """The last training rollout of every replica (gathered by `end`)."""
        return self._replica_timelines

    def _price_speculation(self, stats: dict[str, Any]) -> None:
        """An adaptive engine's planner prices the next rollouts' speculating tails at the
        speed every rank's drafter measured so far (`SpeculativeTail.from_metrics` of their
        summed counts: the same tail on every rank, as the planner's verdicts must be). A
        collective where the engine is adaptive and speculates; nothing otherwise."""
        controller = getattr(self.engine, "controller", None)
        planner = getattr(controller, "planner", None)
        if not self.config.rollout.speculative.enable or planner is None:
            return
        if not hasattr(planner, "set_speculation"):
            return  # a planner of the caller's that prices no speculation
        mine = {k: float(stats.get(k, 0.0)) for k in SPEC_TOTALS}
        shares = all_gather_objects(self.world, mine)
        planner.set_speculation(measured_tail(shares, self.config.rollout.speculative.max_num_seqs))

    def _rank_timeline(self) -> dict[str, Any]:
        timeline = self.rollout_timeline
        return {
            "t": [e["t"] for e in timeline],
            "running": [e["running"] for e in timeline],
            "tp": [e["tp_size"] for e in timeline],
            # speculative verify steps: (start, drafted tokens, accepted tokens)
            "verify": [(e["t"], e["drafted"], e["accepted"]) for e in timeline if e["drafted"]],
            "switches": [
                (d["t"], f"tp{d['current_tp']}->{d['target_tp']}")
                for d in self.rollout_decisions
                if d["action"] == "switch"
            ],
        }

    # ------------------------------------------------------------ the phases

    def _free_cache_engine(self) -> bool:
        """Put the engine to sleep for the policy update where `rollout.free_cache_engine`
        says so (None: on CUDA): its KV cache, and with `rollout.offload_weights` its weights,
        leave the device for the trainer. It wakes before the weight sync (an owed way back
        rebuilds at the sync). Whether it slept."""
        r = self.config.rollout
        free = r.free_cache_engine
        if free is None:
            free = self.world.device.type == "cuda"
        if free:
            self.engine.sleep(level=2 if r.offload_weights else 1)
        return free

    def generate_and_score(
        self, timings: dict[str, float]
    ) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score until the batch is full (DAPO filtering may need several rounds;
        partial rollouts resume last step's unfinished groups), then check that not every
        reward failed (`_check_rewards`)."""
        self._failures = []
        samples, metrics = self._rounds(timings)
        self._check_rewards()
        if self.multi_turn is not None:
            self._check_tools(metrics)
        return samples, metrics

    def update(self, samples: list[Sample], timings: dict[str, float]) -> PolicyUpdate:
        """The policy update (`update.update_policy`: advantages, with KL in the reward or
        GAE's critic first, then the PPO epochs), the engine asleep meanwhile where
        `rollout.free_cache_engine` says so."""
        self._asleep = self._free_cache_engine()
        return update_policy(
            self.config,
            self.trainer,
            samples,
            self.step,
            timings,
            kl_ctrl=self.kl_ctrl,
            critic=self.critic,
        )

    def _rounds(self, timings: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """Generation rounds until the batch is full."""
        if self.config.rollout.over_sample_rate > 0:
            return self._collect_partial(timings)
        filt = self.config.algorithm.filter_groups
        kept: list[list[Sample]] = []  # DAPO: groups with a learning signal, oldest first
        metrics: dict[str, float] = {}
        rounds = 0
        while True:
            rounds += 1
            items = self.loader.next_batch(self.config.data.gen_batch_size)
            before = self.engine.stats()
            with timed(timings, "gen"):
                local = self._generate(
                    items,
                    self.config.rollout.temperature,
                    training_seed_key(self.config, self.step, rounds),
                )
            after = self.engine.stats()
            self.rollout_timeline = after["timeline"]  # the plots show a training rollout
            self.rollout_decisions = after.get("tp_decisions", [])
            metrics.update(_tp_metrics(before, after))
            metrics.update(speculation_metrics(before, after))
            self._price_speculation(after)
            if self.multi_turn is not None:  # every replica's tool calls and turns, once
                mine = self.multi_turn.metrics if self._scores else {}
                shares = all_gather_objects(self.world, mine)
                merge_reward_metrics(metrics, [m for m in shares if m])
            with timed(timings, "reward"):
                samples, reward_shares = self._score(local, failures=self._failures)
            metrics.update(self._learn_lengths(samples, rounds))
            merge_reward_metrics(metrics, reward_shares)
            if not filt.enable:
                return samples, metrics
            by_group: dict[int, list[Sample]] = {}
            for s in samples:
                by_group.setdefault(s.prompt_index, []).append(s)
            f = filter_zero_variance_groups(
                [filter_value(self.config, s) for s in samples], [s.prompt_index for s in samples]
            )
            kept += [by_group[int(g)] for g in f.kept_groups]  # type: ignore[call-overload]
            metrics["dapo/kept_groups"] = metrics.get("dapo/kept_groups", 0.0) + f.num_kept
            metrics["dapo/dropped_groups"] = metrics.get("dapo/dropped_groups", 0.0) + f.num_dropped
            plan = refill(kept, self.config.data.train_batch_size)
            if not plan.draw_more or rounds >= filt.max_num_gen_batches:
                metrics["dapo/gen_rounds"] = float(rounds)
                if not plan.groups:
                    return samples, metrics  # every group was uniform: train on the last round
                return [s for group in plan.groups for s in group], metrics

    def _collect_partial(self, timings: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """Partial rollouts (APRIL): the unfinished groups of the last step resume first, new
        prompts fill up to batch x (1 + over_sample_rate), and generation stops once
        train_batch_size groups have finished; the rest is kept for the next step."""
        r, batch = self.config.rollout, self.config.data.train_batch_size
        want = math.ceil(batch * (1 + r.over_sample_rate))
        fresh = self.loader.next_batch(max(0, want - len(self.partials)))
        entries = [(rid, p.item, p.states) for rid, p in self.partials.items()]
        entries += [(f"s{self.step}-p{item.index}", item, []) for item in fresh]
        # the multi-turn world run gathers every rank's samples; adaptive generate_partial
        # runs each replica's own (`_shares`)
        gathered = self.multi_turn is not None
        dp_rank, dp_size = self._shares(gathered)
        scores = self._first_of_share(gathered)
        replica = self._assign_entries(entries, dp_size)
        counts = [replica.count(j) for j in range(dp_size)]
        quota = _split_quota(batch, counts)[dp_rank]
        mine = [e for e, j in zip(entries, replica, strict=True) if j == dp_rank]
        new = [(rid, item) for rid, item, states in mine if not states]
        resume = [st for _, _, states in mine for st in states]
        seed_base = training_seed_key(self.config, self.step)
        item_of = {rid: item for rid, item, _ in entries}
        before = self.engine.stats()
        done: list[Any]
        rest: list[Any]
        with timed(timings, "gen"):
            if self.multi_turn is not None:
                # each carried group's samples: AgentLoopOutputs and TurnStates, resumed
                # by re-prefilling their conversation under this step's weights
                done, by_group = self.multi_turn.generate_partial(
                    [
                        (
                            rid,
                            item,
                            states,
                            sampling_params(self.config, item, r.n, r.temperature, seed_base),
                        )
                        for rid, item, states in mine
                    ],
                    quota,
                )
                rest = list(by_group.items())
            else:
                done, states = self.engine.generate_partial(
                    [item.prompt_token_ids for _, item in new],
                    [
                        sampling_params(self.config, item, r.n, r.temperature, seed_base)
                        for _, item in new
                    ],
                    quota,
                    request_ids=[rid for rid, _ in new],
                    prompt_keys=[f"train/{item.index}" for _, item in new],
                    resume=resume,
                )
                rest = [(st.request_id, [st]) for st in states]
        stats = self.engine.stats()
        self.rollout_timeline = stats["timeline"]
        self.rollout_decisions = stats.get("tp_decisions", [])
        metrics: dict[str, float] = {}
        if self.multi_turn is not None:  # every replica's tool calls and turns, once
            mine_mt = self.multi_turn.metrics if self._scores else {}
            shares = all_gather_objects(self.world, mine_mt)
            merge_reward_metrics(metrics, [m for m in shares if m])
        with timed(timings, "reward"):
            samples, reward_shares = self._score(
                [(item_of[o.request_id], o) for o in done] if scores else [],
                failures=self._failures,
            )
        left = [
            pair
            for share in all_gather_objects(self.world, rest if scores else [])
            for pair in share
        ]
        # a group's stale tokens once (its samples share its request id)
        stale = sum(self._stale_tokens.get(rid, 0) for rid in {s.request_id for s in samples})
        self.partials = {}
        for rid, carried in left:
            self.partials.setdefault(rid, Partial(item_of[rid], [])).states.extend(carried)
        # tokens sampled under this step's (soon old) weights: the off-policy share next step
        self._stale_tokens = {
            rid: sum(_made(st) for st in p.states) for rid, p in self.partials.items()
        }
        metrics.update(self._learn_lengths(samples, 1))
        metrics.update(_tp_metrics(before, stats))
        metrics.update(speculation_metrics(before, stats))
        self._price_speculation(stats)
        merge_reward_metrics(metrics, reward_shares)
        total = sum(s.model_tokens for s in samples)
        metrics["partial/resumed_groups"] = float(sum(1 for rid, _, st in entries if st))
        metrics["partial/finished_groups"] = float(len({s.request_id for s in samples}))
        metrics["partial/buffered_groups"] = float(len(self.partials))
        metrics["partial/off_policy_token_frac"] = stale / total if total else 0.0
        return samples, metrics

    def _greedy_baselines(
        self, samples: list[Sample], timings: dict[str, float]
    ) -> dict[str, float]:
        """ReMax (verl's order): each trained prompt's greedy response, generated with the
        weights that sampled the batch and scored like the samples (rule rewards and the
        reward model); its reward becomes every sample of the prompt's `baseline`. Costs one
        more response per prompt; the prompt's KV is a prefix-cache hit."""
        items = [self._items_by_index[i] for i in sorted({s.prompt_index for s in samples})]
        with timed(timings, "gen_max"):
            local = self._generate(items, 0.0, GREEDY_BASELINE_SEED_KEY, n=1, split="greedy")
        with timed(timings, "reward_baseline"):
            greedy, _ = self._score(local)
        baseline = {g.prompt_index: g.reward for g in greedy}
        for s in samples:
            s.baseline = baseline[s.prompt_index]
        scores = list(baseline.values())
        return {
            "remax/baseline_score/mean": float(np.mean(scores)),
            "remax/baseline_response_length/mean": float(
                np.mean([len(g.token_ids) for g in greedy])
            ),
        }

    def _assign_entries(
        self, entries: list[tuple[str, PromptItem, list[Any]]], dp_size: int
    ) -> list[int]:
        """Share (of `dp_size`) of each group: resumed ones by their predicted remaining
        work."""
        predicted = []
        for _, item, states in entries:
            expected = self.predictor.expected_length(f"train/{item.index}")
            done = max((_made(st) for st in states), default=0)
            predicted.append(max(expected - done, 1.0))
        self._predicted = {
            item.index: p for (_, item, _), p in zip(entries, predicted, strict=True)
        }
        if dp_size == 1:
            return [0] * len(entries)
        return self._replicas(predicted, self.config.rollout.n, dp_size)

    def _replicas(self, predicted: list[float], n: int, shares: int) -> list[int]:
        """The share (of `shares`) of each prompt of `n` samples each: round robin, or
        longest predicted work first onto the least loaded share."""
        lpt = self.config.rollout.prompt_assignment == "length_aware"
        return assign_prompts(
            predicted, [n] * len(predicted), shares, "lpt" if lpt else "round_robin"
        )

    def _generate(
        self,
        items: Sequence[PromptItem],
        temperature: float,
        seed_key: tuple[int, ...],
        n: int | None = None,
        split: str = "train",
    ) -> list[tuple[PromptItem, Any]]:
        """This replica's share of `items`, generated (with `rollout.multi_turn`: by the agent
        loop, as `scoring.TrajectoryOutput`s). With adaptive TP every rank takes part,
        including ranks whose replica got no prompt."""
        mine = self._my_share(items, n or self.config.rollout.n)
        if not mine and not self._collective:
            if self.multi_turn is not None:
                self.multi_turn.metrics = {}
            return []
        params = [
            sampling_params(
                self.config,
                item,
                n or self.config.rollout.n,
                temperature,
                seed_key,
                validation=split == "validation",
            )
            for item in mine
        ]
        if self.multi_turn is not None:
            return list(zip(mine, self.multi_turn.generate(mine, params), strict=True))
        outputs = self.engine.generate(
            [item.prompt_token_ids for item in mine],
            params,
            prompt_keys=[f"{split}/{item.index}" for item in mine],
        )
        return list(zip(mine, outputs, strict=True))

    def _my_share(self, items: Sequence[PromptItem], n: int) -> list[PromptItem]:
        """This replica's prompts (see `_replicas`). A prompt's n samples stay together (their
        prefill is shared)."""
        dp_rank, dp_size = self._shares(gathered=True)
        if dp_size == 1:
            return list(items)
        predicted = [self.predictor.expected_length(f"train/{item.index}") for item in items]
        self._predicted = {item.index: p for item, p in zip(items, predicted, strict=True)}
        replica = self._replicas(predicted, n, dp_size)
        return [item for item, r in zip(items, replica, strict=True) if r == dp_rank]

    def _learn_lengths(self, samples: list[Sample], round_: int) -> dict[str, float]:
        """Report finished lengths to the predictor's writer (which learns those it has not
        learnt during the rollout) and the run's length log; report how well it predicted
        this batch."""
        if self.is_first:
            append_lengths(self.run_dir, self.step, samples, round_ - 1)
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.prompt_index, []).append(s)
        errors = []
        for pidx, group in groups.items():
            predicted = self._predicted.get(pidx, self.predictor.expected_length(f"train/{pidx}"))
            errors.append(abs(predicted - np.mean([len(s.token_ids) for s in group])))
        self.length_groups.learn_groups(
            (f"train/{pidx}", [(s.request_id, len(s.token_ids)) for s in group])
            for pidx, group in groups.items()
        )
        return {"lenpredict/prompt_mean_abs_error": float(np.mean(errors)) if errors else 0.0}

    def _check_rewards(self) -> None:
        """Say so (an error line, rank 0) when every sample's reward failed this step; stop
        the run (RewardsFailed, every rank alike) after reward.max_failed_steps such steps in
        a row, or at its last step when every step failed so."""
        line = self.reward_guard.observe(
            self.step,
            FailureSummary.total(self._failures),
            last=self.step == self.config.total_steps,
        )
        if line is not None and self.is_first:
            print(f"patrl: error: {line}", file=sys.stderr, flush=True)

    def _check_tools(self, metrics: dict[str, float]) -> None:
        """Say so (an error line, rank 0) when every tool call of this step failed; stop the
        run (ToolsFailed, every rank alike: the counters are every replica's) after
        reward.max_failed_steps such steps in a row (agent.tool_guard)."""
        last = self.step == self.config.total_steps
        line = self.tool_guard.observe(self.step, metrics, last=last)
        if line is not None and self.is_first:
            print(f"patrl: error: {line}", file=sys.stderr, flush=True)

    def _score(
        self,
        local: list[tuple[PromptItem, Any]],
        training: bool = True,
        failures: list[FailureSummary] | None = None,
    ) -> tuple[list[Sample], list[dict[str, float]]]:
        """Every replica's samples of `local`, scored on the replica's first rank and gathered on
        every rank, and each replica's reward metrics. The reward model scores training
        samples only: validation measures the rule rewards (pass@1). Every rank calls it (a
        sharded reward model scores in collectives). `failures` collects every replica's
        FailureSummary."""
        learned = self.learned if training else None
        mine: tuple[list[Sample], dict[str, float], FailureSummary] = ([], {}, FailureSummary())
        if self.rewards is not None:
            overlong = overlong_buffer(self.config) if training else None
            mine = score_outputs(self.rewards, local, learned, overlong)
        elif learned is not None:  # a sharded RM: every rank takes part in its forwards
            learned.score([])
        shares = all_gather_objects(self.world, mine)
        if failures is not None:
            failures += [summary for _, _, summary in shares]
        return [s for scored, _, _ in shares for s in scored], [m for _, m, _ in shares if m]

    def sync_weights(self) -> None:
        """Stream the trainer's full weights into the engine, one bucket at a time (waking it
        first if the update put it to sleep)."""
        if self._asleep:
            self.engine.wake_up()
            self._asleep = False
        bucket_bytes = self.config.rollout.update_weights_bucket_megabytes << 20
        self.engine.load_weights(
            _flatten(self.trainer.iter_full_weights(bucket_bytes)), version=self.step
        )

    def _validate(self) -> dict[str, float]:
        """Every validation prompt's `rollout.val_kwargs.n` responses, `data.val_batch_size`
        prompts generated at a time, sampled as `rollout.val_kwargs` says (greedy by default),
        scored: pass@1 and verl's per-source metrics."""
        assert self.val_set is not None
        start = time.perf_counter()
        local = []
        val = self.config.rollout.val_kwargs
        for batch in validation_batches(self.config, self.val_set):
            local += self._generate(
                batch, val.temperature, VALIDATION_SEED_KEY, n=val.n, split="validation"
            )
        samples, _ = self._score(local, training=False)
        if self.is_first and self.config.trainer.validation_data_dir:
            items = {item.index: item for item in self.val_set.items}
            rows = generation_rows(samples, items, self.tokenizer, self.step)
            dump_generations(self.config.trainer.validation_data_dir, self.step, rows)
        return validation_metrics(samples, start, data_sources(self.val_set.items))


def _flatten(buckets: Iterator[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket


def _split_quota(total: int, counts: list[int]) -> list[int]:
    """`total` finished groups asked of replicas holding `counts` groups, in proportion (the
    largest remainders round up), never more than a replica holds."""
    held = sum(counts)
    if held == 0:
        return [0] * len(counts)
    total = min(total, held)
    exact = [total * c / held for c in counts]
    quota = [math.floor(x) for x in exact]
    for j in sorted(range(len(counts)), key=lambda j: quota[j] - exact[j])[: total - sum(quota)]:
        quota[j] += 1
    return [min(q, c) for q, c in zip(quota, counts, strict=True)]


def _tp_metrics(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """This rollout's adaptive-TP activity (nothing under static TP)."""
    if "tp_switches" not in after:
        return {}
    # On the critical path: what the checks added to the busiest replica's decode time.
    decode = after["tp_critical_decode_s"] - before["tp_critical_decode_s"]
    control = after["tp_critical_control_s"] - before["tp_critical_control_s"]
    return {
        "rollout/tp_switches": after["tp_switches"] - before["tp_switches"],
        "rollout/tp_max": float(max((r["tp_size"] for r in after["timeline"]), default=1)),
        "rollout/tp_control_fraction": control / decode if decode > 0 else 0.0,
        "timing_s/tp_reconfig": after["tp_reconfig_s"] - before["tp_reconfig_s"],
    }


SyncGRPO = SyncSchedule  # the name it had while it ran GRPO only
