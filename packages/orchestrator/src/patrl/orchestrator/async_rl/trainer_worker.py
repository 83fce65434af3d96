"""An async trainer rank: takes each step's tickets from the store in ticket order, trains on
them with decoupled PPO and publishes the new weights; the first trainer rank logs (rollout
rank 0's validations too), checkpoints and ends the run (docs/async.md). A `run.Schedule`:
`run.RunLoop` drives it as it drives the sync schedule."""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from patrl.lenpredict import LengthPredictor
from patrl.orchestrator.agent.tool_guard import ToolFailureGuard
from patrl.orchestrator.async_rl.job import AsyncJob
from patrl.orchestrator.async_rl.tickets import (
    TRAINED,
    GroupRecord,
    sample_key,
    spec_metrics,
    step_tickets,
)
from patrl.orchestrator.build import critic_config, starts_from_adapter, trainer_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.drafter_checkpoint import load_drafter, remember_samples, save_drafter
from patrl.orchestrator.generations import dump_generations, generation_rows
from patrl.orchestrator.kl_control import (
    build_kl_controller,
    load_kl_state,
    needs_reference,
    save_kl_state,
)
from patrl.orchestrator.length_log import append_lengths
from patrl.orchestrator.rewards import FailureGuard, FailureSummary
from patrl.orchestrator.run import (
    RunLoop,
    RunResult,
    find_checkpoint,
    load_run_state,
    run_state,
    validates,
)
from patrl.orchestrator.scoring import merge_reward_metrics
from patrl.orchestrator.step_metrics import step_metrics, timed
from patrl.orchestrator.update import update_policy
from patrl.rollout.config import SpeculativeConfig
from patrl.rollout.drafter import new_drafter
from patrl.trainer import Critic, Trainer
from patrl.trainer.reward_model import load_tokenizer


class TrainerWorker:
    """Trains step s on tickets [(s-1)B, sB) once all are in, then publishes version s."""

    def __init__(self, job: AsyncJob, group: dist.ProcessGroup) -> None:
        self.job = job
        self.config = job.config
        self.world = job.world
        self.control = job.control
        self.run_dir = job.run_dir
        self.loader = job.loader
        self.predictor = LengthPredictor()  # checkpointed as the sync schedule's, never fed
        self.batch_size = job.config.data.train_batch_size
        self.is_first = job.world.rank == job.trainer_ranks[0]
        self._tokenizer: Any = None  # trainer.rollout_data_dir's (`_dump`)
        self._items: dict[int, PromptItem] = {}
        mesh = None
        if len(job.trainer_ranks) > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, job.world.device.type)
        config = trainer_config(self.config)
        config.behav_imp_weight_cap = self.config.async_rl.behaviour_weight_cap
        self.trainer = Trainer(
            config,
            job.model_dir,
            mesh=mesh,
            device=job.world.device,
            reference=needs_reference(self.config),
        )
        # PPO with a critic: the value model trains on the trainer ranks, beside the actor.
        self.critic = (
            Critic(
                critic_config(self.config),
                self.config.critic.model.path or job.model_dir,
                mesh=mesh,
                device=job.world.device,
            )
            if self.config.use_critic
            else None
        )
        self.kl_ctrl = build_kl_controller(self.config.algorithm.kl_ctrl)
        self.reward_guard = FailureGuard(self.config.reward.max_failed_steps)
        self.tool_guard = ToolFailureGuard(self.config.reward.max_failed_steps)
        self.step = 0
        # (step, ticket, oldest, newest token version) of every trained sample.
        self.trained_versions: list[tuple[int, int, int, int]] = []
        # (step, ticket, rank, life, migrated_from, migrated_tokens) of every trained group.
        self.trained_groups: list[tuple[int, int, int, int, int | None, int]] = []
        self.published: list[tuple[int, float]] = []  # (version, when announced: time.time())
        self.all_lengths: list[int] = []
        # The speculation history checkpoints carry: every trained group's complete responses
        # (all rollout ranks'), kept by a drafter's rules; None without speculation.
        spec = self.config.rollout.speculative.model_dump(exclude={"latency_profile"})
        self.drafter_history = new_drafter(SpeculativeConfig(**spec))
        self._resumed_from: Path | None = None
        self._waited_us = 0
        self._val_logged = -1  # the newest validated version logged

    def run(self) -> RunResult:
        """Resume, train every step, log (rank 0's validations too) and save (`run.RunLoop`)."""
        return RunLoop(self).run()

    # ------------------------------------------------------------- run state

    def checkpoint_to_resume(self) -> Path | None:
        return find_checkpoint(self.config, self.is_first)

    def state_dict(self) -> dict[str, Any]:
        return run_state(self.step, self.loader, self.predictor)

    def before_save(self) -> None:
        """Nothing to gather: every trainer rank read every trained group."""

    def save_files(self, staging: Path) -> None:
        save_kl_state(self.kl_ctrl, staging)
        if self.drafter_history is not None:
            save_drafter(self.drafter_history.state_dict(), staging)

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.step = load_run_state(state, self.loader, self.predictor)
        load_kl_state(self.kl_ctrl, checkpoint)
        load_drafter(self.drafter_history, checkpoint)
        self._resumed_from = checkpoint

    def begin(self) -> None:
        """Weights of a resumed step (or of a fresh run that starts from a LoRA adapter the
        rollout engines have not got), the ticket counter and the loader, then "start"; a
        resumed run's validations were logged before it stopped."""
        published = self.step > 0 or starts_from_adapter(self.config)
        if published:
            self._publish(self.step)
        if self.is_first:
            self.control.bump("tickets", self.step * self.batch_size)
            start = {
                "step": self.step,
                "loader": self.loader.state_dict(),
                "published": published,
                # where the rollout ranks' drafters find the history (drafter_checkpoint)
                "checkpoint": None if self._resumed_from is None else str(self._resumed_from),
            }
            self.control.put("start", pickle.dumps(start))
        self._val_logged = self.step if self.step > 0 else -1

    def validate(self, final: bool = False) -> dict[int, dict[str, float]]:
        """The validations rank 0 finished (first trainer rank; others: none), in version
        order up to the first not yet in; with `final`, waits for all that are due up to the
        current step."""
        if not self.is_first:
            return {}
        due = [
            v
            for v in range(self._val_logged + 1, self.step + 1)
            if self.job.val_set is not None and validates(self.config, v)
        ]
        done: dict[int, dict[str, float]] = {}
        for v in due:
            key = f"val/{v}"

            def arrived(key: str = key) -> bool:
                return self.control.has([key])

            if final:
                self.control.wait_until(arrived, f"validation {v}", [0])
            elif not arrived():
                break
            done[v] = pickle.loads(self.control.get(key))
            self._val_logged = v
        return done

    def end(self) -> None:
        """The first trainer rank tells every rank the run is over."""
        if self.is_first:
            self.control.finish()

    def close(self) -> None:
        """Nothing held beyond the run."""

    def timelines(self) -> list[dict[str, Any]]:
        """No generation timelines: the trainer ranks do not generate."""
        return []

    # ------------------------------------------------------------------ step

    def train_step(self) -> dict[str, float]:
        """Step `step`: wait for its tickets' scored groups, update (advantages, decoupled PPO
        epochs), publish the weights; its metrics row."""
        cfg = self.config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        self.control.beat()  # a step may take a while: the rollout ranks watch this beat
        records = self._take_batch(timings)
        samples = [s for r in records for s in r.samples]
        if self.is_first and cfg.trainer.rollout_data_dir:
            self._dump(samples)
        remember_samples(self.drafter_history, samples)  # in ticket order
        line = self.reward_guard.observe(
            self.step,
            FailureSummary.total(r.failures for r in records),
            last=self.step == cfg.total_steps,
        )
        if line is not None and self.is_first:
            print(f"patrl: error: {line}", file=sys.stderr, flush=True)
        if cfg.rollout.multi_turn.enable:  # the groups' multi_turn/* counters, as sync's
            counters: dict[str, float] = {}
            merge_reward_metrics(counters, [r.reward_metrics for r in records])
            line = self.tool_guard.observe(self.step, counters, last=self.step == cfg.total_steps)
            if line is not None and self.is_first:
                print(f"patrl: error: {line}", file=sys.stderr, flush=True)
        update = update_policy(
            cfg,
            self.trainer,
            samples,
            self.step,
            timings,
            decoupled=True,
            kl_ctrl=self.kl_ctrl,
            critic=self.critic,
        )
        self.control.beat()
        last = self.step == cfg.total_steps
        # After the last step nobody generates; only a validation would read the weights.
        if not last or (self.job.val_set is not None and validates(cfg, self.step)):
            with timed(timings, "update_weights"):
                self._publish(self.step)
        timings["step"] = time.perf_counter() - start
        self.loader.next_batch()  # kept in step with the tickets, for checkpoints
        waits = {
            "time/wait_for_batch": timings["wait_for_batch"],
            "time/wait_for_weights": self._rollout_wait_s(),
        }
        merge_reward_metrics(waits, [r.reward_metrics for r in records if r.reward_metrics])
        metrics = step_metrics(cfg, timings, samples, update, self.world.size, waits)
        metrics.update(self._staleness(records))
        metrics.update(self._migrations(records))
        metrics.update(spec_metrics(records))
        self.all_lengths += [len(s.token_ids) for s in samples]
        if self.is_first:
            append_lengths(self.run_dir, self.step, samples)
        return metrics

    train_one_step = train_step  # its name before `run.Schedule`

    def _dump(self, samples: list[Any]) -> None:
        """`trainer.rollout_data_dir`: the step's responses, as the sync schedule dumps them
        (the tokenizer loaded on first use: the trainer ranks have no engine)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.job.model_dir, "model.path")
            self._items = {item.index: item for item in self.loader.dataset}
        rows = generation_rows(samples, self._items, self._tokenizer, self.step)
        dump_generations(str(self.config.trainer.rollout_data_dir), self.step, rows)

    def _take_batch(self, timings: dict[str, float]) -> list[GroupRecord]:
        """This step's groups, in ticket order; waits (idle) until all of them are in."""
        tickets = step_tickets(self.step, self.batch_size)
        keys = [sample_key(t) for t in tickets]
        with timed(timings, "wait_for_batch"):
            # A lost rollout rank's tickets migrate: only all of them lost fails the wait.
            self.control.wait_until(
                lambda: self.control.has(keys),
                f"the samples of step {self.step}",
                self.job.rollout_ranks,
                need_progress=True,
                any_peer=True,
            )
        records = [pickle.loads(self.control.get(k)) for k in keys]
        # The last trainer rank to read a step's samples replaces them by a tombstone: the
        # store's memory is freed, and a late duplicate (see put_first) cannot come back.
        readers = len(self.job.trainer_ranks)
        if self.control.bump(f"read/{self.step}") == readers:
            for t in tickets:
                self.control.put(sample_key(t), TRAINED)
        return records

    def _staleness(self, records: list[GroupRecord]) -> dict[str, float]:
        """How many versions behind the trainer each trained sample's oldest token was. Only
        model tokens count: a multi-turn sample's tool tokens were sampled by no policy."""
        version = self.step - 1  # the weights this step's update starts from
        eta = self.config.async_rl.max_staleness
        per_sample, per_token = [], []
        for r in records:
            for vs in self._model_versions(r):
                oldest, newest = (min(vs), max(vs)) if vs else (version, version)
                self.trained_versions.append((self.step, r.ticket, oldest, newest))
                per_sample.append(version - oldest)
                per_token += [version - v for v in vs]
        worst = max(per_sample)
        if worst > eta:  # the admission rule makes this impossible: a bug, not a condition
            raise RuntimeError(
                f"step {self.step}: a sample is {worst} versions stale, above "
                f"async_rl.max_staleness={eta}"
            )
        out = {
            "async/staleness_mean": float(np.mean(per_sample)),
            "async/staleness_max": float(worst),
            "async/token_staleness_mean": float(np.mean(per_token)) if per_token else 0.0,
            "async/mixed_version_samples": float(
                sum(
                    1
                    for r in records
                    for vs in self._model_versions(r)
                    if vs and min(vs) != max(vs)
                )
            ),
        }
        for s in range(eta + 1):
            out[f"async/staleness_count/{s}"] = float(per_sample.count(s))
        return out

    @staticmethod
    def _model_versions(record: GroupRecord) -> list[list[int]]:
        """Each sample's model tokens' versions (a multi-turn sample's tool tokens left out)."""
        return [
            [v for v, m in zip(vs, s.response_mask or [1] * len(vs), strict=True) if m]
            for s, vs in zip(record.samples, record.versions, strict=True)
        ]

    def _migrations(self, records: list[GroupRecord]) -> dict[str, float]:
        """This step's groups finished by another rank than the one that lost them, and the
        tokens kept from the lost rank's reports; lost ranks so far (counters of the run)."""
        migrated = [r for r in records if r.migrated_from is not None]
        for r in records:
            self.trained_groups.append(
                (self.step, r.ticket, r.rank, r.life, r.migrated_from, r.migrated_tokens)
            )
        return {
            "async/migrated_requests": float(len(migrated)),
            "async/migrated_tokens": float(sum(r.migrated_tokens for r in migrated)),
            "async/preemptions": float(self.control.counter("preemptions")),
            "async/stalls": float(self.control.counter("stalls")),
            "async/rejoins": float(self.control.counter("rejoins")),
            "async/duplicate_groups": float(self.control.counter("duplicates")),
        }

    def _rollout_wait_s(self) -> float:
        """Rollout ranks' idle time since the last step, per rank (they wait for weights)."""
        total = sum(self.control.counter(f"wait_weights_us/{r}") for r in self.job.rollout_ranks)
        delta, self._waited_us = total - self._waited_us, total
        return delta / 1e6 / len(self.job.rollout_ranks)

    # ------------------------------------------------------------------ weights

    def _publish(self, version: int) -> None:
        """Full weights to disk as `version` (every trainer rank gathers, the first writes),
        then announce it; versions no rollout rank still holds are deleted."""
        bucket_bytes = self.config.rollout.update_weights_bucket_megabytes << 20
        buckets = self.trainer.iter_full_weights(bucket_bytes)
        if not self.is_first:
            for _ in buckets:  # the gathers are collectives of the trainer group
                pass
            return
        self.job.weights.publish(version, buckets)
        self.control.bump("weights/latest", version - self.control.counter("weights/latest"))
        self.published.append((version, time.time()))
        held = [self._loaded(r) for r in self.job.rollout_ranks]
        self.job.weights.prune(min([*held, version]))

    def _loaded(self, rank: int) -> int:
        key = f"loaded/{rank}"
        return int(self.control.get(key)) if self.control.has([key]) else 0
