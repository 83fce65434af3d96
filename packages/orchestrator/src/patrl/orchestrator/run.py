"""The run loop both schedules share: resume, then per step train, validate, log and save.

`RunLoop.run` reads top to bottom: the schedule (`sync_loop.SyncSchedule`, the async trainer
ranks' `async_rl.trainer_worker.TrainerWorker`) is an object the loop calls, never a set of
hooks it overrides. Checkpoints hold the trainer's state, the policy (and critic) as a Hugging
Face directory, the schedule's `state_dict` and its own files (`run_checkpoint` writes them
atomically)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from patrl.lenpredict import LengthPredictor
from patrl.orchestrator import run_checkpoint
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
    last step. A `val_only` run validates the weights it starts from (a resumed step's too)."""
    t = config.trainer
    if step == 0 or t.val_only:
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
    found = run_checkpoint.resume_target(config.run_dir, t.resume_mode, t.resume_from_path)
    if found is None or not (found / run_checkpoint.STATE_FILE).is_file():
        return None
    step = int(run_checkpoint.read_state(found)["step"])
    if step < t.total_training_steps:
        return None
    return (
        f"patrl: nothing to do: checkpoint {found} is at step {step} and "
        f"trainer.total_training_steps={t.total_training_steps}; the run's metrics.jsonl, plots "
        f"and checkpoints are in {config.run_dir}/. Raise trainer.total_training_steps to train "
        "on from it, or start afresh with trainer.resume_mode=disable or another "
        "trainer.experiment_name."
    )


class Schedule(Protocol):
    """What `RunLoop` drives on one rank. `step` counts the steps taken (the resumed one after
    `load_state_dict`); `trainer` and `critic` are the models the loop checkpoints; `is_first`
    says whether this rank logs, plots and commits checkpoints."""

    config: JobConfig
    run_dir: Path
    is_first: bool
    step: int
    trainer: Trainer
    critic: Critic | None
    all_lengths: list[int]  # every trained response's length, for the plots

    def checkpoint_to_resume(self) -> Path | None:
        """The checkpoint to resume from (`find_checkpoint`), the same on every rank."""
        ...

    def begin(self) -> None:
        """After the resume, before the first step: put the resumed weights where generation
        reads them."""
        ...

    def train_step(self) -> dict[str, float]:
        """Step `step`: generate, score, advantages, update, weight sync; its metrics row."""
        ...

    def validate(self, final: bool = False) -> dict[int, dict[str, float]]:
        """The validation metrics not returned before, by the step whose weights they
        measured (`validates` says which are due); `final`: the run is over, wait for every
        one due."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The run state a checkpoint's `state.json` holds (`run_state`)."""
        ...

    def before_save(self) -> None:
        """Every rank, before a checkpoint's files are staged: gather what the first rank's
        `save_files` writes of the other ranks (a collective where the schedule has one)."""
        ...

    def save_files(self, staging: Path) -> None:
        """Write the schedule's own files into a checkpoint being staged (first rank)."""
        ...

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore `state_dict`'s state and the files `save_files` wrote into `checkpoint`."""
        ...

    def end(self) -> None:
        """After the last step (every rank): what the run's end owes its peers."""
        ...

    def close(self) -> None:
        """Release what the schedule holds, however the run ended."""
        ...

    def timelines(self) -> list[dict[str, Any]]:
        """Generation timelines for the plots."""
        ...


def run_state(step: int, loader: PromptLoader, predictor: LengthPredictor) -> dict[str, Any]:
    """A checkpoint's `state.json`: the step, the loader's position and the length history."""
    return {
        "step": step,
        "loader": loader.state_dict(),
        "length_predictor": predictor.state_dict(),
    }


def load_run_state(state: dict[str, Any], loader: PromptLoader, predictor: LengthPredictor) -> int:
    """Restore `run_state`'s loader and predictor; the step it was saved at."""
    loader.load_state_dict(state["loader"])
    predictor.load_state_dict(state["length_predictor"])
    return int(state["step"])


def find_checkpoint(config: JobConfig, is_first: bool) -> Path | None:
    """The checkpoint the `trainer.resume_*` settings name, or None (warnings on the first
    rank)."""
    t = config.trainer
    return run_checkpoint.resume_target(
        config.run_dir, t.resume_mode, t.resume_from_path, warn=_warn if is_first else None
    )


class RunLoop:
    """Runs `schedule`'s steps until `trainer.total_training_steps`, resuming first from a
    checkpoint (`trainer.val_only`: validates the weights it starts from, and no step); the
    first rank (`is_first`) logs, plots and commits checkpoints, every rank trains and saves."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.config = schedule.config
        self.run_dir = schedule.run_dir

    def run(self) -> RunResult:
        s, total = self.schedule, self.config.total_steps
        self.resume()
        s.begin()
        logger = self._open_logger() if s.is_first else None
        try:
            self._log_rows(logger, s.validate())  # before training: trainer.val_before_train
            while s.step < total and not self.config.trainer.val_only:
                s.step += 1
                metrics = s.train_step()  # generate, score, advantages, update, weight sync
                validated = s.validate()
                self._log(logger, s.step, metrics | validated.pop(s.step, {}))
                self._log_rows(logger, validated)  # earlier steps' (async: validated beside)
                if saves(self.config, s.step):
                    self.save()
            if not self.config.trainer.val_only:
                self._log_rows(logger, s.validate(final=True))
            s.end()
        finally:
            if logger is not None:
                logger.close()
            s.close()
        if logger is None:
            return RunResult(s.step, [], self.run_dir)
        self._report(logger)
        return RunResult(s.step, logger.history, self.run_dir)

    def _open_logger(self) -> MetricsLogger:
        cfg = self.config.trainer
        return MetricsLogger(
            self.run_dir,
            cfg.logger,
            self.config.total_steps,
            self.schedule.step,
            label=self.config.algorithm.adv_estimator,
            wandb_init={
                "project": cfg.project_name,
                "name": cfg.experiment_name,
                "config": self.config.model_dump(mode="json"),
            },
        )

    @staticmethod
    def _log(logger: MetricsLogger | None, step: int, metrics: dict[str, float]) -> None:
        if logger is not None:
            logger.log(step, metrics)

    def _log_rows(self, logger: MetricsLogger | None, rows: dict[int, dict[str, float]]) -> None:
        for step in sorted(rows):
            self._log(logger, step, rows[step])

    def _report(self, logger: MetricsLogger) -> None:
        """The summary table, and the plots with `trainer.plots`."""
        print("\n" + logger.summary())
        if self.config.trainer.plots:
            written = plot_run(
                logger.history,
                self.schedule.all_lengths,
                self.schedule.timelines(),
                self.run_dir,
                self.config.data.max_response_length,
            )
            print("plots: " + ", ".join(str(p) for p in written))

    # ------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        """Checkpoint this step: every trainer rank writes its shards and takes part in the
        Hugging Face export's gathers; the first writes the HF directories and commits.
        Weights holding inf/NaN are never saved; a failed write leaves no staging behind, and
        a full disk is said so (JobError)."""
        s = self.schedule
        for model in (s.trainer, s.critic):
            if model is not None:
                model.check_finite()
        staging = run_checkpoint.staging_dir(self.run_dir, s.step)
        try:
            return self._write_checkpoint(staging)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            shutil.rmtree(staging, ignore_errors=True)
            full = run_checkpoint.disk_full(err, staging, self._checkpoint_bytes())
            if full is None or isinstance(err, KeyboardInterrupt):
                raise
            raise JobError(
                f"{full} while writing the checkpoint of step {s.step} to {staging}. Nothing "
                "of it was kept; the newest complete checkpoint is "
                f"{run_checkpoint.latest_checkpoint(self.run_dir) or 'none'}. Free space (or "
                "lower trainer.max_checkpoints_to_keep, or move trainer.default_local_dir) and "
                "rerun: the run resumes from that checkpoint",
                collective=False,
            ) from err

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: per model, fp32 weights and two AdamW moments,
        and its Hugging Face export when it is saved."""
        total = 0
        for model in (self.schedule.trainer, self.schedule.critic):
            if model is None:
                continue
            numel = sum(p.numel() for p in model.model.parameters())
            total += numel * 12
            if "hf_model" in model.config.checkpoint.save_contents:
                total += numel * model.export_dtype.itemsize
        return total

    def _write_checkpoint(self, staging: Path) -> Path:
        s = self.schedule
        s.before_save()
        if s.is_first:
            run_checkpoint.prepare_staging(self.run_dir, s.step)
        s.trainer.group.barrier()
        s.trainer.save(staging / run_checkpoint.TRAINER_DIR)
        self._export(s.trainer, run_checkpoint.hf_dir(staging))
        if s.critic is not None:
            critic_dir = staging / run_checkpoint.CRITIC_DIR
            s.critic.save(critic_dir)
            self._export(s.critic, critic_dir / run_checkpoint.HF_DIR)
        s.trainer.group.barrier()
        if s.is_first:
            s.save_files(staging)
            run_checkpoint.commit(
                self.run_dir, s.step, s.state_dict(), self.config.trainer.max_checkpoints_to_keep
            )
        s.trainer.group.barrier()
        return run_checkpoint.step_dir(self.run_dir, s.step)

    @staticmethod
    def _export(trainer: Trainer, path: Path) -> None:
        """The HF directory of `trainer`'s model: its weights when its checkpoint contents
        have hf_model; config, generation config and tokenizer always, so that
        `python -m patrl.trainer.export` can turn the checkpoint into one later."""
        trainer.export_hf(path, weights="hf_model" in trainer.config.checkpoint.save_contents)

    def resume(self) -> None:
        """Continue from the checkpoint the schedule names (`checkpoint_to_resume`), if any:
        the models, then the schedule's state (`load_state_dict`), `step` included."""
        s = self.schedule
        found = s.checkpoint_to_resume()
        if found is None:
            return
        if not (found / run_checkpoint.STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{found} is not a complete patrl checkpoint (no {run_checkpoint.STATE_FILE})"
            )
        run_checkpoint.check_sound(found)
        state = run_checkpoint.read_state(found)
        s.trainer.load(found / run_checkpoint.TRAINER_DIR)
        if s.critic is not None:
            if not (found / run_checkpoint.CRITIC_DIR).is_dir():
                raise ValueError(
                    f"{found} has no {run_checkpoint.CRITIC_DIR}/ (saved without a critic) but "
                    "this run trains one (algorithm.adv_estimator=gae); resume it with the "
                    "estimator it was saved with, or start afresh (trainer.resume_mode=disable)"
                )
            s.critic.load(found / run_checkpoint.CRITIC_DIR)
        s.load_state_dict(state, found)
        if s.is_first:
            print(f"resumed from {found} at step {s.step}")


def _warn(message: str) -> None:
    print(f"patrl: warning: {message}", file=sys.stderr, flush=True)
