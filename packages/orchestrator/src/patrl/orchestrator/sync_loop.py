"""The synchronous, colocated GRPO loop: every rank generates, then every rank trains.

One step:
 1. draw `data.train_batch_size` prompts (every rank draws the same ones) and hand each DP
    rollout replica its share, the `rollout.n` samples of a prompt kept together;
 2. generate: each replica's engine runs its prompts (one prefill per prompt, n forks); with
    `rollout.adaptive_tp` the engines start data-parallel and the planner may fold replicas
    into larger TP groups for the long tail (patrl.rollout.adaptive), learning lengths online;
 3. score: each replica's first rank runs the reward functions on its samples;
 4. gather every replica's samples on every rank; group-relative advantages;
 5. `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` prompts. The
    PPO "old" policy's logprobs come from a scoring pass before the first update, or, when the
    batch makes a single optimizer step, from that update's own forward (no extra pass); either
    way their distance from the engine's is logged (`training/rollout_probs_diff_*`);
 6. stream the new weights, bucket by bucket, into the engine (a new weight version);
 7. log metrics; validate every `trainer.test_freq` steps; checkpoint every `trainer.save_freq`.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patrl.lenpredict import LengthPredictor, assign_prompts, usable_tp_sizes
from patrl.orchestrator import checkpointing
from patrl.orchestrator.advantages import compute_advantages, filter_zero_variance_groups, refill
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem, PromptLoader, dataset_for
from patrl.orchestrator.distributed import World, all_gather_objects, barrier, broadcast_object
from patrl.orchestrator.metrics import MetricsLogger, plot_run
from patrl.orchestrator.profiling import cache_root, ensure_profile, job_grid
from patrl.orchestrator.rewards import RewardManager
from patrl.rollout import (
    AdaptiveEngine,
    AdaptiveTP,
    EngineConfig,
    SamplingParams,
    SequenceState,
    make_engine,
)
from patrl.tpreshard.groups import GroupCache
from patrl.trainer import PolicyBatch, Trainer, TrainerConfig

PARTIALS_FILE = "partial_rollouts.pt"  # buffered unfinished groups, in each checkpoint


@dataclass(slots=True)
class Sample:
    """One scored response, as gathered on every rank."""

    prompt_index: int  # PromptItem.index: the group id
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float
    request_id: str = ""


@dataclass(slots=True)
class Partial:
    """An unfinished group of a partial rollout, resumed first at the next step."""

    item: PromptItem
    states: list[SequenceState]


@dataclass(slots=True)
class RunResult:
    steps: int
    history: list[dict[str, float]]
    run_dir: Path


class SyncGRPO:
    def __init__(
        self, config: JobConfig, world: World, model_dir: str, train_files: Any, val_files: Any
    ) -> None:
        self.config = config
        self.world = world
        self.run_dir = config.run_dir
        self.model_dir = model_dir
        seed_everything(config.trainer.seed)
        self.tokenizer = _load_tokenizer(model_dir)
        self.train_set = dataset_for(config, self.tokenizer, train_files)
        self.val_set = dataset_for(config, self.tokenizer, val_files) if val_files else None
        if world.is_first:
            for name, ds in (("train", self.train_set), ("validation", self.val_set)):
                if ds is not None:
                    print(
                        f"{name}: {len(ds)} prompts, {ds.num_filtered_overlong} of {ds.num_rows} "
                        f"filtered as longer than data.max_prompt_length={config.data.max_prompt_length}"
                    )
        self.loader = PromptLoader(
            self.train_set.items,
            config.data.train_batch_size,
            shuffle=config.data.shuffle,
            seed=config.data.seed,
        )
        # Learns every prompt's response length; all ranks see the same lengths (the adaptive
        # engine all-gathers them as samples finish; else every step's samples are gathered),
        # so all ranks hold the same predictor and derive the same prompt assignment.
        self.predictor = LengthPredictor()
        engine = engine_config(config, model_dir, world)
        adaptive = isinstance(engine.tp_policy, AdaptiveTP)
        tp_sizes = (
            list(engine.tp_policy.candidates)
            if isinstance(engine.tp_policy, AdaptiveTP)
            else [config.rollout.tensor_model_parallel_size]
        )
        self.groups = (
            GroupCache(
                tp_sizes, world_size=world.size, rank=world.rank, tp_comm=config.rollout.tp_comm
            )
            if world.distributed
            else None
        )
        self.engine = make_engine(
            engine,
            None if adaptive or self.groups is None else self.groups.layout(tp_sizes[0]),
            self.groups,
            lengths=self.predictor if adaptive else None,
        )
        self.layout = self.engine.layout if world.distributed else None
        self._online_lengths = (
            isinstance(self.engine, AdaptiveEngine) and self.engine.controller is not None
        )
        self._predicted: dict[int, float] = {}  # prompt -> expected length at assignment
        self.trainer = Trainer(
            trainer_config(config), model_dir, mesh=self._mesh(), device=world.device
        )
        self.rewards = (
            RewardManager(
                [(f.name, f.weight) for f in config.reward.functions],
                num_workers=config.reward.num_workers,
                timeout_s=config.reward.timeout_s,
            )
            if self._scores
            else None
        )
        self.partials: dict[str, Partial] = {}  # request id -> unfinished group
        self._stale_tokens: dict[str, int] = {}  # tokens a buffered group made with old weights
        self.rollout_timeline: list[dict[str, Any]] = []
        self.rollout_decisions: list[dict[str, Any]] = []
        self.step = 0
        self.all_lengths: list[int] = []

    # ---------------------------------------------------------------- set-up

    @property
    def _scores(self) -> bool:
        """The first rank of each TP group scores its replica's samples."""
        return self.layout is None or self.layout.tp_rank == 0

    @property
    def _dp(self) -> tuple[int, int]:
        return (0, 1) if self.layout is None else (self.layout.dp_rank, self.layout.dp_size)

    def _mesh(self) -> Any:
        if not self.world.distributed:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.world.device.type, (self.world.size,))

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        cfg = self.config.trainer
        self._maybe_resume()
        logger = (
            MetricsLogger(self.run_dir, cfg.logger, cfg.total_training_steps, self.step)
            if self.world.is_first
            else None
        )
        try:
            if (
                cfg.val_before_train
                and self.step == 0
                and self.val_set is not None
                and cfg.test_freq
            ):
                self._log(logger, 0, self.validate())
            while self.step < cfg.total_training_steps:
                self.step += 1
                metrics = self.train_one_step()
                if cfg.test_freq and self.val_set is not None and self.step % cfg.test_freq == 0:
                    metrics.update(self.validate())
                self._log(logger, self.step, metrics)
                last = self.step == cfg.total_training_steps
                if (cfg.save_freq and self.step % cfg.save_freq == 0) or last:
                    self.save()
        finally:
            if logger is not None:
                logger.close()
            if self.rewards is not None:
                self.rewards.close()
        history = logger.history if logger is not None else []
        if logger is not None:
            print("\n" + logger.summary())
            if cfg.plots:
                written = plot_run(history, self.all_lengths, [self._timeline()], self.run_dir)
                print("plots: " + ", ".join(str(p) for p in written))
        return RunResult(self.step, history, self.run_dir)

    def _log(self, logger: MetricsLogger | None, step: int, metrics: dict[str, float]) -> None:
        if logger is not None:
            logger.log(step, metrics)

    # ----------------------------------------------------------------- step

    def train_one_step(self) -> dict[str, float]:
        cfg = self.config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        samples, gen_metrics = self._collect_samples(timings)
        batch, rewards, advantages = policy_batch(cfg, samples)
        # One on-policy optimizer step takes its old logprobs from the update's own forward
        # (as TRL does with num_iterations=1); only several steps per batch need a scoring
        # pass before the first (verl's old_log_prob).
        fused = single_update(cfg, samples)
        if not fused:
            with _timed(timings, "old_log_prob"):
                batch.old_logprobs = self.trainer.compute_logprobs(batch)
        with _timed(timings, "update_actor"):
            actor_metrics = ppo_update(self.config, self.trainer, batch, samples, self.step)
        old = self.trainer.scored_logprobs() if fused else batch.old_logprobs
        assert old is not None
        with _timed(timings, "update_weights"):
            self.sync_weights()
        timings["step"] = time.perf_counter() - start
        metrics = {f"timing_s/{k}": v for k, v in timings.items()}
        metrics.update(gen_metrics)
        metrics.update(actor_metrics)
        metrics.update(
            _batch_metrics(samples, rewards, advantages, self.config.data.max_response_length)
        )
        metrics.update(_probs_diff(samples, old))
        tokens = sum(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/throughput"] = tokens / timings["step"] / self.world.size
        self.all_lengths += [len(s.token_ids) for s in samples]
        return metrics

    def _collect_samples(self, timings: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score until the batch is full (DAPO filtering may need several rounds)."""
        if self.config.rollout.over_sample_rate > 0:
            return self._collect_partial(timings)
        filt = self.config.algorithm.filter_groups
        kept: list[list[Sample]] = []  # DAPO: groups with a learning signal, oldest first
        metrics: dict[str, float] = {}
        rounds = 0
        while True:
            rounds += 1
            items = self.loader.next_batch()
            before = self.engine.stats()
            with _timed(timings, "gen"):
                local = self._generate(
                    items, self.config.rollout.temperature, self._sampling_seed_base(rounds)
                )
            after = self.engine.stats()
            self.rollout_timeline = after["timeline"]  # the plots show a training rollout
            self.rollout_decisions = after.get("tp_decisions", [])
            metrics.update(_tp_metrics(before, after))
            with _timed(timings, "reward"):
                scored, reward_metrics = self._score(local)
            samples = [s for share in all_gather_objects(self.world, scored) for s in share]
            metrics.update(self._learn_lengths(samples, rounds))
            _merge_reward_metrics(
                metrics, [m for m in all_gather_objects(self.world, reward_metrics) if m]
            )
            if not filt.enable:
                return samples, metrics
            by_group: dict[int, list[Sample]] = {}
            for s in samples:
                by_group.setdefault(s.prompt_index, []).append(s)
            f = filter_zero_variance_groups(
                [s.reward for s in samples], [s.prompt_index for s in samples]
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
        replica = self._assign_entries(entries)
        dp_rank, dp_size = self._dp
        counts = [replica.count(j) for j in range(dp_size)]
        quota = _split_quota(batch, counts)[dp_rank]
        mine = [e for e, j in zip(entries, replica, strict=True) if j == dp_rank]
        new = [(rid, item) for rid, item, states in mine if not states]
        resume = [st for _, _, states in mine for st in states]
        seed_base = self._sampling_seed_base()
        item_of = {rid: item for rid, item, _ in entries}
        with _timed(timings, "gen"):
            done, rest = self.engine.generate_partial(
                [item.prompt_token_ids for _, item in new],
                [self._params(item, r.n, r.temperature, seed_base) for _, item in new],
                quota,
                request_ids=[rid for rid, _ in new],
                prompt_keys=[f"train/{item.index}" for _, item in new],
                resume=resume,
            )
        stats = self.engine.stats()
        self.rollout_timeline = stats["timeline"]
        self.rollout_decisions = stats.get("tp_decisions", [])
        with _timed(timings, "reward"):
            scored, reward_metrics = self._score([(item_of[o.request_id], o) for o in done])
        samples = [s for share in all_gather_objects(self.world, scored) for s in share]
        left = [
            st
            for share in all_gather_objects(self.world, rest if self._scores else [])
            for st in share
        ]
        stale = sum(self._stale_tokens.get(s.request_id, 0) for s in samples)
        self.partials = {}
        for st in left:
            p = self.partials.setdefault(st.request_id, Partial(item_of[st.request_id], []))
            p.states.append(st)
        self._stale_tokens = {
            rid: sum(len(st.output_token_ids) for st in p.states)
            for rid, p in self.partials.items()
        }
        metrics = self._learn_lengths(samples, 1)
        _merge_reward_metrics(
            metrics, [m for m in all_gather_objects(self.world, reward_metrics) if m]
        )
        total = sum(len(s.token_ids) for s in samples)
        metrics["partial/resumed_groups"] = float(sum(1 for rid, _, st in entries if st))
        metrics["partial/finished_groups"] = float(len({s.request_id for s in samples}))
        metrics["partial/buffered_groups"] = float(len(self.partials))
        metrics["partial/off_policy_token_frac"] = stale / total if total else 0.0
        return samples, metrics

    def _assign_entries(self, entries: list[tuple[str, PromptItem, list[Any]]]) -> list[int]:
        """Replica of each group: resumed ones by their predicted remaining work."""
        _, dp_size = self._dp
        predicted = []
        for _, item, states in entries:
            expected = self.predictor.expected_length(f"train/{item.index}")
            done = max((len(st.output_token_ids) for st in states), default=0)
            predicted.append(max(expected - done, 1.0))
        self._predicted = {
            item.index: p for (_, item, _), p in zip(entries, predicted, strict=True)
        }
        if dp_size == 1:
            return [0] * len(entries)
        lpt = self.config.rollout.prompt_assignment == "length_aware"
        n = self.config.rollout.n
        return assign_prompts(
            predicted, [n] * len(entries), dp_size, "lpt" if lpt else "round_robin"
        )

    def _params(
        self, item: PromptItem, n: int, temperature: float, seed_key: tuple[int, ...]
    ) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=r.top_p if temperature > 0 else 1.0,
            top_k=r.top_k if temperature > 0 else 0,
            max_tokens=self.config.data.max_response_length,
            # Python's hash of a tuple of ints is the same in every process and run.
            seed=hash((*seed_key, item.index)) & 0x7FFF_FFFF_FFFF,
        )

    def _sampling_seed_base(self, round_: int = 1) -> tuple[int, ...]:
        """Seeds depend on (run seed, step, round, prompt) only: a resumed run samples the same."""
        return (self.config.trainer.seed, self.step, round_)

    def _generate(
        self,
        items: Sequence[PromptItem],
        temperature: float,
        seed_key: tuple[int, ...],
        n: int | None = None,
        split: str = "train",
    ) -> list[tuple[PromptItem, Any]]:
        """This replica's share of `items`, generated. With adaptive TP every rank takes part,
        including ranks whose replica got no prompt."""
        mine = self._my_share(items, n or self.config.rollout.n)
        if not mine and not self._online_lengths:
            return []
        params = [
            self._params(item, n or self.config.rollout.n, temperature, seed_key) for item in mine
        ]
        outputs = self.engine.generate(
            [item.prompt_token_ids for item in mine],
            params,
            prompt_keys=[f"{split}/{item.index}" for item in mine],
        )
        return list(zip(mine, outputs, strict=True))

    def _my_share(self, items: Sequence[PromptItem], n: int) -> list[PromptItem]:
        """This replica's prompts: round robin, or longest predicted work first onto the least
        loaded replica. A prompt's n samples stay together (their prefill is shared)."""
        dp_rank, dp_size = self._dp
        if dp_size == 1:
            return list(items)
        predicted = [self.predictor.expected_length(f"train/{item.index}") for item in items]
        self._predicted = {item.index: p for item, p in zip(items, predicted, strict=True)}
        lpt = self.config.rollout.prompt_assignment == "length_aware"
        replica = assign_prompts(
            predicted, [n] * len(items), dp_size, "lpt" if lpt else "round_robin"
        )
        return [item for item, r in zip(items, replica, strict=True) if r == dp_rank]

    def _learn_lengths(self, samples: list[Sample], round_: int) -> dict[str, float]:
        """Feed finished lengths to the predictor; report how well it predicted this batch."""
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.prompt_index, []).append(s)
        errors = []
        for pidx, group in groups.items():
            predicted = self._predicted.get(pidx, self.predictor.expected_length(f"train/{pidx}"))
            errors.append(abs(predicted - np.mean([len(s.token_ids) for s in group])))
            if self._online_lengths:
                continue  # the adaptive engine learnt these lengths as they finished
            gid = f"{self.step}:{round_}:{pidx}"
            self.predictor.start_group(gid, f"train/{pidx}", len(group))
            for i, s in enumerate(group):
                self.predictor.observe_finished(f"{gid}:{i}", gid, len(s.token_ids))
        return {"lenpredict/prompt_mean_abs_error": float(np.mean(errors)) if errors else 0.0}

    def _score(self, local: list[tuple[PromptItem, Any]]) -> tuple[list[Sample], dict[str, float]]:
        if not self._scores or not local:
            return [], {}
        assert self.rewards is not None
        flat = [(item, out, c) for item, out in local for c in out.outputs]
        result = self.rewards.score(
            [c.text if c.text is not None else "" for _, _, c in flat],
            [item.answer for item, _, _ in flat],
            [dict(item.extra) for item, _, _ in flat],
        )
        samples = [
            Sample(
                item.index,
                item.prompt_token_ids,
                c.token_ids,
                c.logprobs,
                c.finish_reason,
                reward,
                out.request_id,
            )
            for (item, out, c), reward in zip(flat, result.rewards, strict=True)
        ]
        return samples, result.metrics()

    def sync_weights(self) -> None:
        """Stream the trainer's full weights into the engine, one bucket at a time."""
        bucket_bytes = self.config.rollout.update_weights_bucket_megabytes << 20
        self.engine.load_weights(
            _flatten(self.trainer.iter_full_weights(bucket_bytes)), version=self.step
        )

    # ------------------------------------------------------------ validation

    def validate(self) -> dict[str, float]:
        """pass@1 on the validation set at rollout.val_temperature (greedy by default)."""
        assert self.val_set is not None
        start = time.perf_counter()
        items = self.val_set.items
        if self.config.data.val_batch_size:
            items = items[: self.config.data.val_batch_size]
        local = self._generate(
            items, self.config.rollout.val_temperature, (-1,), n=1, split="validation"
        )
        scored, _ = self._score(local)
        samples = [s for share in all_gather_objects(self.world, scored) for s in share]
        scores = [s.reward for s in samples]
        return {
            "val-core/acc/mean@1": float(np.mean(scores)) if scores else 0.0,
            "val/response_length/mean": float(np.mean([len(s.token_ids) for s in samples]))
            if samples
            else 0.0,
            "timing_s/testing": time.perf_counter() - start,
        }

    # ----------------------------------------------------------- checkpoints

    def save(self) -> Path:
        staging = checkpointing.staging_dir(self.run_dir, self.step)
        if self.world.is_first:
            checkpointing.prepare_staging(self.run_dir, self.step)
        barrier(self.world)
        self.trainer.save(staging / "trainer")
        barrier(self.world)
        final = checkpointing.step_dir(self.run_dir, self.step)
        if self.world.is_first:
            torch.save(
                {"partials": self.partials, "stale_tokens": self._stale_tokens},
                staging / PARTIALS_FILE,
            )
            state = {
                "step": self.step,
                "loader": self.loader.state_dict(),
                "length_predictor": self.predictor.state_dict(),
            }
            checkpointing.commit(
                self.run_dir, self.step, state, self.config.trainer.max_checkpoints_to_keep
            )
        barrier(self.world)
        return final

    def _maybe_resume(self) -> None:
        t = self.config.trainer
        if t.resume_mode == "disable":
            return
        found = (
            Path(t.resume_from_path)
            if t.resume_mode == "resume_path" and t.resume_from_path
            else None
        )
        if found is None:
            found = checkpointing.latest_checkpoint(self.run_dir) if self.world.is_first else None
            found = broadcast_object(self.world, found)
        if found is None:
            return
        if not (found / checkpointing.STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{found} is not a complete patrl checkpoint (no {checkpointing.STATE_FILE})"
            )
        state = checkpointing.read_state(found)
        self.trainer.load(found / "trainer")
        self.loader.load_state_dict(state["loader"])
        self.predictor.load_state_dict(state["length_predictor"])
        if (found / PARTIALS_FILE).is_file():
            saved = torch.load(found / PARTIALS_FILE, weights_only=False)
            self.partials, self._stale_tokens = saved["partials"], saved["stale_tokens"]
        self.step = int(state["step"])
        self.sync_weights()
        if self.world.is_first:
            print(f"resumed from {found} at step {self.step}")

    def _timeline(self) -> dict[str, Any]:
        timeline = self.rollout_timeline
        return {
            "t": [e["t"] for e in timeline],
            "running": [e["running"] for e in timeline],
            "switches": [
                (d["t"], f"tp{d['current_tp']}->{d['target_tp']}")
                for d in self.rollout_decisions
                if d["action"] == "switch"
            ],
        }


def _load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _flatten(buckets: Iterator[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket


def _subset(batch: PolicyBatch, rows: list[int]) -> PolicyBatch:
    def pick(values: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return None if values is None else [values[i] for i in rows]

    return PolicyBatch(
        input_ids=[batch.input_ids[i] for i in rows],
        loss_mask=[batch.loss_mask[i] for i in rows],
        advantages=[batch.advantages[i] for i in rows],
        old_logprobs=pick(batch.old_logprobs),
        ref_logprobs=pick(batch.ref_logprobs),
        behaviour_logprobs=pick(batch.behaviour_logprobs),
    )


def _merge_reward_metrics(into: dict[str, float], shares: list[dict[str, float]]) -> None:
    """Add up counters across replicas (and rounds); average means; the slowest replica's time."""
    for key in {k for share in shares for k in share}:
        values = [share[key] for share in shares if key in share]
        if key.endswith("/mean"):
            into[key] = float(np.mean(values))
        elif key.startswith("timing_s/"):
            into[key] = into.get(key, 0.0) + max(values)
        else:
            into[key] = into.get(key, 0.0) + sum(values)


def _batch_metrics(
    samples: list[Sample], rewards: np.ndarray, advantages: np.ndarray, max_len: int
) -> dict[str, float]:
    lengths = np.array([len(s.token_ids) for s in samples], dtype=np.float64)
    prompts = np.array([len(s.prompt_token_ids) for s in samples], dtype=np.float64)
    return {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/max": float(rewards.max()),
        "critic/score/min": float(rewards.min()),
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/p90": float(np.percentile(lengths, 90)),
        "response_length/clip_ratio": float(
            np.mean([s.finish_reason == "length" for s in samples])
        ),
        "prompt_length/mean": float(prompts.mean()),
    }


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


def _probs_diff(samples: list[Sample], trainer_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """How far the engine's token probabilities are from the trainer's (verl's names)."""
    diffs = []
    for s, lp in zip(samples, trainer_logprobs, strict=True):
        n = len(s.token_ids)
        trainer = lp[-n:].double().exp()
        engine = torch.tensor(s.logprobs, dtype=torch.float64).exp()
        diffs.append((trainer - engine).abs())
    d = torch.cat(diffs)
    return {
        "training/rollout_probs_diff_mean": float(d.mean()),
        "training/rollout_probs_diff_max": float(d.max()),
        "training/rollout_probs_diff_std": float(d.std()) if d.numel() > 1 else 0.0,
    }


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


# --- the loop's building blocks (the async loop uses them too) ---------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def engine_config(config: JobConfig, model_dir: str, world: World) -> EngineConfig:
    """The rollout engine of this job; under adaptive TP with its latency profile (measured
    now, every rank taking part, unless cached or given)."""
    r, d = config.rollout, config.data
    base = EngineConfig(
        model=model_dir,
        dtype=r.dtype,
        device=str(world.device),
        attention_backend=r.attention_backend,
        tp_comm=r.tp_comm,
        block_size=r.block_size,
        num_kv_blocks=r.num_kv_blocks,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=d.max_prompt_length + d.max_response_length,
        enable_prefix_caching=r.enable_prefix_caching,
        keep_full_weights=r.adaptive_tp.keep_full_weights,
    )
    a = r.adaptive_tp
    candidates = usable_tp_sizes(a.candidates, world.size)
    if not a.enable or len(candidates) < 2:
        if a.enable and world.is_first and world.distributed:
            print(
                f"rollout.adaptive_tp: candidates {a.candidates} leave fewer than two TP sizes "
                f"dividing the world size {world.size}; running static TP"
            )
        return base
    profile = a.profile
    if profile is None:
        per_replica = -(-d.train_batch_size // world.size) * r.n
        grid = job_grid(candidates, per_replica, d.max_prompt_length + d.max_response_length)
        profile = str(ensure_profile(model_dir, base, world, grid, cache_root()))
    policy = AdaptiveTP(
        candidates=candidates,
        check_every=a.check_every,
        check_budget=a.check_budget,
        margin=a.margin,
        kv_policy=a.kv_policy,
        profile=profile,
    )
    return base.model_copy(update={"tp_policy": policy})


def trainer_config(config: JobConfig) -> TrainerConfig:
    fields = TrainerConfig.model_fields
    values = {k: v for k, v in config.actor.model_dump().items() if k in fields}
    values["seed"] = config.trainer.seed
    return TrainerConfig(**values)


def policy_batch(
    config: JobConfig, samples: list[Sample], behaviour: bool = False
) -> tuple[PolicyBatch, np.ndarray, np.ndarray]:
    """Group-relative advantages of scored samples, and the trainer's batch (with the
    samples' own logprobs as behaviour logprobs, for decoupled PPO, when `behaviour`)."""
    groups = np.array([s.prompt_index for s in samples])
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    advantages = compute_advantages(
        config.algorithm.adv_estimator,
        rewards,
        groups,
        norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
    )
    batch = PolicyBatch.from_responses(
        [s.prompt_token_ids for s in samples],
        [s.token_ids for s in samples],
        [float(a) for a in advantages],
        behaviour_logprobs=[s.logprobs for s in samples] if behaviour else None,
    )
    return batch, rewards, advantages


def single_update(config: JobConfig, samples: list[Sample]) -> bool:
    """Whether `ppo_update` makes exactly one optimizer step over the whole batch."""
    prompts = len({s.prompt_index for s in samples})
    return config.actor.ppo_epochs == 1 and _prompts_per_mini_batch(config, prompts) >= prompts


def _prompts_per_mini_batch(config: JobConfig, prompts: int) -> int:
    # A batch can hold more or fewer prompts than train_batch_size (dynamic sampling,
    # over-sampling): mini-batches keep their share of it.
    mini = config.actor.ppo_mini_batch_size
    return max(1, prompts * mini // max(1, config.data.train_batch_size))


def ppo_update(
    config: JobConfig, trainer: Trainer, batch: PolicyBatch, samples: list[Sample], step: int
) -> dict[str, float]:
    """`ppo_epochs` passes over mini-batches of whole prompt groups."""
    actor = config.actor
    prompts = sorted({s.prompt_index for s in samples})
    per_mini = _prompts_per_mini_batch(config, len(prompts))
    rng = np.random.default_rng(config.trainer.seed * 7919 + step)
    sums: dict[str, list[float]] = {}
    for _ in range(actor.ppo_epochs):
        order = rng.permutation(len(prompts)) if actor.ppo_epochs > 1 else np.arange(len(prompts))
        for start in range(0, len(prompts), per_mini):
            chosen = {prompts[i] for i in order[start : start + per_mini]}
            rows = [i for i, s in enumerate(samples) if s.prompt_index in chosen]
            metrics = trainer.train_step(_subset(batch, rows))
            for k, v in metrics.items():
                sums.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in sums.items()}
