"""The run loop both schedules share: steps, logging, validation cadence, checkpoints, resume.

A schedule subclasses `RunLoop`, gives it a trainer, a loader and a length predictor, and
fills in `train_one_step` and the hooks it needs. Checkpoints hold the trainer's state, the
policy (and critic) as a Hugging Face directory, the loader's position and the length history
(`checkpointing` writes them atomically)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patrl.lenpredict import LengthPredictor
from patrl.orchestrator import checkpointing
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptLoader
from patrl.orchestrator.errors import JobError
from patrl.orchestrator.metrics import MetricsLogger, plot_run
from patrl.trainer import Critic, Trainer


@dataclass(slots=True)
class RunResult:
    steps: int
    history: list[dict[str, float]]
    run_dir: Path


def validates(config: JobConfig, step: int) -> bool:
    """Whether the weights after step `step` are validated (verl's rule): step 0 (before
    training) with `val_before_train`; with `test_freq > 0`, every `test_freq` steps and the
    last step."""
    t = config.trainer
    if step == 0:
        return t.val_before_train
    if t.test_freq <= 0:
        return False
    return step % t.test_freq == 0 or step == config.total_steps


def validates_ever(config: JobConfig) -> bool:
    """Whether the run validates at all (so needs its validation set)."""
    return config.trainer.val_before_train or config.trainer.test_freq > 0


def saves(config: JobConfig, step: int) -> bool:
    """Whether step `step` ends with a checkpoint: with `save_freq > 0` every `save_freq` steps
    and the last (verl's rule); with 0 the last only; with -1 never."""
    t = config.trainer
    if t.save_freq < 0:
        return False
    return bool(t.save_freq and step % t.save_freq == 0) or step == config.total_steps


def completed(config: JobConfig) -> str | None:
    """A one-line notice if the run has no step left to take, else None: the checkpoint it would
    resume from (`trainer.resume_*`) is already at `trainer.total_training_steps` or past it.
    Checked before anything is built, so re-running a finished job costs nothing."""
    t = config.trainer
    if t.total_training_steps is None:  # not resolved (resolve_schedule) yet: cannot tell
        return None
    found = checkpointing.resume_target(config.run_dir, t.resume_mode, t.resume_from_path)
    if found is None or not (found / checkpointing.STATE_FILE).is_file():
        return None
    step = int(checkpointing.read_state(found)["step"])
    if step < t.total_training_steps:
        return None
    return (
        f"patrl: nothing to do: checkpoint {found} is at step {step} and "
        f"trainer.total_training_steps={t.total_training_steps}; the run's metrics.jsonl, plots "
        f"and checkpoints are in {config.run_dir}/. Raise trainer.total_training_steps to train "
        "on from it, or start afresh with trainer.resume_mode=disable or another "
        "trainer.experiment_name."
    )


class RunLoop:
    """Runs steps until `trainer.total_training_steps`, resuming first from a checkpoint; the
    first rank (`is_first`) logs, plots and commits checkpoints, every rank trains and saves."""

    config: JobConfig
    run_dir: Path
    trainer: Trainer
    critic: Critic | None = None  # algorithm.adv_estimator=gae: checkpointed beside the actor
    loader: PromptLoader
    predictor: LengthPredictor
    step: int
    all_lengths: list[int]  # every trained response's length, for the plots
    is_first: bool

    def train_one_step(self) -> dict[str, float]:
        """One step of the schedule, returning its metrics: each schedule (SyncGRPO, the async
        TrainerWorker) defines it; the base class has no step of its own."""
        raise NotImplementedError(f"{type(self).__name__} does not define train_one_step")

    def run(self) -> RunResult:
        cfg = self.config.trainer
        total = self.config.total_steps
        self.resume()
        self.started()
        logger = (
            MetricsLogger(
                self.run_dir,
                cfg.logger,
                total,
                self.step,
                label=self.config.algorithm.adv_estimator,
                wandb_init={
                    "project": cfg.project_name,
                    "name": cfg.experiment_name,
                    "config": self.config.model_dump(mode="json"),
                },
            )
            if self.is_first
            else None
        )
        try:
            self.before_steps(logger)
            while self.step < total:
                self.step += 1
                self.log_step(logger, self.train_one_step())
                if saves(self.config, self.step):
                    self.save()
            self.after_steps(logger)
        finally:
            if logger is not None:
                logger.close()
            self.close()
        if logger is None:
            return RunResult(self.step, [], self.run_dir)
        print("\n" + logger.summary())
        if cfg.plots:
            written = plot_run(
                logger.history,
                self.all_lengths,
                self.timelines(),
                self.run_dir,
                self.config.data.max_response_length,
            )
            print("plots: " + ", ".join(str(p) for p in written))
        return RunResult(self.step, logger.history, self.run_dir)

    # ------------------------------------------------------------------- hooks

    def started(self) -> None:
        """After resume, before the logger opens."""

    def before_steps(self, logger: MetricsLogger | None) -> None:
        """Before the first step of this run."""

    def log_step(self, logger: MetricsLogger | None, metrics: dict[str, float]) -> None:
        """Log the row of the step just taken."""
        if logger is not None:
            logger.log(self.step, metrics)

    def after_steps(self, logger: MetricsLogger | None) -> None:
        """After the last step, before the logger closes."""

    def close(self) -> None:
        """Release what the schedule holds, however the run ended."""

    def timelines(self) -> list[dict[str, Any]]:
        """Generation timelines for the plots."""
        return []

    def find_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (the `trainer.resume_*` settings), or None."""
        t = self.config.trainer
        return checkpointing.resume_target(
            self.run_dir, t.resume_mode, t.resume_from_path, warn=_warn if self.is_first else None
        )

    def save_extra(self, staging: Path) -> None:
        """Write the schedule's own files into a checkpoint being staged (first rank)."""

    def restored(self, checkpoint: Path) -> None:
        """Read the schedule's own files back after a resume to `self.step`."""

    # ------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        """Checkpoint this step: every trainer rank writes its shards and takes part in the
        Hugging Face export's gathers; the first writes the HF directories and commits.
        Weights holding inf/NaN are never saved; a failed write leaves no staging behind, and
        a full disk is said so (JobError)."""
        for model in (self.trainer, self.critic):
            if model is not None:
                model.check_finite()
        staging = checkpointing.staging_dir(self.run_dir, self.step)
        try:
            return self._write_checkpoint(staging)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            shutil.rmtree(staging, ignore_errors=True)
            full = checkpointing.disk_full(err, staging, self._checkpoint_bytes())
            if full is None or isinstance(err, KeyboardInterrupt):
                raise
            raise JobError(
                f"{full} while writing the checkpoint of step {self.step} to {staging}. Nothing "
                "of it was kept; the newest complete checkpoint is "
                f"{checkpointing.latest_checkpoint(self.run_dir) or 'none'}. Free space (or "
                "lower trainer.max_checkpoints_to_keep, or move trainer.default_local_dir) and "
                "rerun: the run resumes from that checkpoint",
                collective=False,
            ) from err

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: per model, fp32 weights and two AdamW moments,
        and its Hugging Face export when it is saved."""
        total = 0
        for model in (self.trainer, self.critic):
            if model is None:
                continue
            numel = sum(p.numel() for p in model.model.parameters())
            total += numel * 12
            if "hf_model" in model.config.checkpoint.save_contents:
                total += numel * model.export_dtype.itemsize
        return total

    def _write_checkpoint(self, staging: Path) -> Path:
        if self.is_first:
            checkpointing.prepare_staging(self.run_dir, self.step)
        self.trainer.group.barrier()
        self.trainer.save(staging / checkpointing.TRAINER_DIR)
        self._export(self.trainer, checkpointing.hf_dir(staging))
        if self.critic is not None:
            critic_dir = staging / checkpointing.CRITIC_DIR
            self.critic.save(critic_dir)
            self._export(self.critic, critic_dir / checkpointing.HF_DIR)
        self.trainer.group.barrier()
        if self.is_first:
            self.save_extra(staging)
            state = {
                "step": self.step,
                "loader": self.loader.state_dict(),
                "length_predictor": self.predictor.state_dict(),
            }
            checkpointing.commit(
                self.run_dir, self.step, state, self.config.trainer.max_checkpoints_to_keep
            )
        self.trainer.group.barrier()
        return checkpointing.step_dir(self.run_dir, self.step)

    @staticmethod
    def _export(trainer: Trainer, path: Path) -> None:
        """The HF directory of `trainer`'s model: its weights when its checkpoint contents
        have hf_model; config, generation config and tokenizer always, so that
        `python -m patrl.trainer.export` can turn the checkpoint into one later."""
        trainer.export_hf(path, weights="hf_model" in trainer.config.checkpoint.save_contents)

    def resume(self) -> None:
        """Continue from the checkpoint `find_checkpoint` names, if any."""
        found = self.find_checkpoint()
        if found is None:
            return
        if not (found / checkpointing.STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{found} is not a complete patrl checkpoint (no {checkpointing.STATE_FILE})"
            )
        checkpointing.check_sound(found)
        state = checkpointing.read_state(found)
        self.trainer.load(found / checkpointing.TRAINER_DIR)
        if self.critic is not None:
            if not (found / checkpointing.CRITIC_DIR).is_dir():
                raise ValueError(
                    f"{found} has no {checkpointing.CRITIC_DIR}/ (saved without a critic) but "
                    "this run trains one (algorithm.adv_estimator=gae); resume it with the "
                    "estimator it was saved with, or start afresh (trainer.resume_mode=disable)"
                )
            self.critic.load(found / checkpointing.CRITIC_DIR)
        self.loader.load_state_dict(state["loader"])
        self.predictor.load_state_dict(state["length_predictor"])
        self.step = int(state["step"])
        self.restored(found)
        if self.is_first:
            print(f"resumed from {found} at step {self.step}")


def _warn(message: str) -> None:
    print(f"patrl: warning: {message}", file=sys.stderr, flush=True)
