"""Faults of one process's run through the CLI entry point: a full disk while checkpointing, a
damaged newest checkpoint, rewards that always fail, weights gone non-finite. Each ends with a
message naming the cause and the way out, and leaves nothing half-written."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.main import main
from patrl_testkit.jobs import addition_job, tiny_job_overrides


def always_raises(response: str, answer: str) -> float:
    raise ValueError("no answer parser for this format")


def overrides(assets: Path, run_dir: Path, **extra: Any) -> list[str]:
    return tiny_job_overrides(assets, run_dir, **{"trainer.total_training_steps": 2, **extra})


@contextlib.contextmanager
def small_filesystem(path: Path, size_kib: int) -> Iterator[bool]:
    """A tmpfs of `size_kib` at `path` where this process may mount one (root on Linux),
    yielding True; else an ordinary directory, yielding False."""
    path.mkdir(parents=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.e2e
def test_a_full_disk_says_so_and_leaves_no_partial_checkpoint(
    assets: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint of this job takes about 1.7 MB; the run dir gets 1.2 MB. Where no tmpfs can
    be mounted, the disk is filled the way torch reports it (its zip writer's short write)
    and the free space read as the tmpfs would leave it."""
    run_dir = tmp_path / "small"
    with small_filesystem(run_dir, 1200) as mounted:
        if not mounted:
            import shutil

            from torch.distributed.checkpoint import filesystem

            def short_write(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
                )

            monkeypatch.setattr(filesystem, "_write_item", short_write)
            usage = shutil.disk_usage(tmp_path)
            monkeypatch.setattr(
                shutil, "disk_usage", lambda p: type(usage)(usage.total, usage.total, 200_000)
            )
        code = main(overrides(assets, run_dir, **{"trainer.total_training_steps": 1}))
        err = capsys.readouterr().err
        left = sorted(p.name for p in run_dir.iterdir())
    assert code == 1
    line = next(x for x in err.splitlines() if x.startswith("patrl: rank 0: no space left"))
    assert str(run_dir) in line and "MiB free" in line and "needs about" in line
    assert "the newest complete checkpoint is none" in line
    assert "Traceback" not in err and "unexpected pos" not in err
    assert not [n for n in left if n.startswith("global_step_")], left  # no .tmp, no partial


@pytest.mark.e2e
def test_a_damaged_newest_checkpoint_is_skipped_and_an_explicit_one_refused(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(overrides(assets, tmp_path)) == 0
    newest = run_checkpoint.step_dir(tmp_path, 2)
    shard = next((newest / run_checkpoint.TRAINER_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated after the save, say by a full disk
    capsys.readouterr()

    assert main(overrides(assets, tmp_path, **{"trainer.total_training_steps": 3})) == 0
    out = capsys.readouterr()
    warning = f"patrl: warning: checkpoint {newest} is damaged: {shard} is"
    assert warning in out.err and "resuming from the newest sound one before it" in out.err
    assert f"resumed from {run_checkpoint.step_dir(tmp_path, 1)} at step 1" in out.out

    # Steps 2 and 3 were retrained and saved over the damaged one; now damage step 3's and
    # ask for it by name: preflight refuses it, naming the file and the other checkpoints.
    newest = run_checkpoint.step_dir(tmp_path, 3)
    shard = next((newest / run_checkpoint.TRAINER_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-64])
    explicit = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": newest}
    assert main(overrides(assets, tmp_path, **explicit)) == 2
    err = capsys.readouterr().err
    assert f"trainer.resume_from_path: checkpoint '{newest}' is damaged: {shard} is" in err
    assert str(run_checkpoint.step_dir(tmp_path, 2)) in err and "trainer.resume_mode=disable" in err


@pytest.mark.e2e
def test_rewards_that_always_fail_stop_the_run_naming_the_cause(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "test_e2e_faults:always_raises"
    extra = {
        "reward.functions": f'[{{name: "{spec}"}}]',
        "reward.max_failed_steps": 2,
        "trainer.total_training_steps": 5,
    }
    assert main(overrides(assets, tmp_path, **extra)) == 1
    err = capsys.readouterr().err.splitlines()
    step1 = [x for x in err if x.startswith("patrl: error: step 1: the reward of every one of 8")]
    assert step1 and "(1 of reward.max_failed_steps=2)" in step1[0]
    (stop,) = [x for x in err if x.startswith("patrl: step 2: the reward of every one of 8")]
    assert f"{spec}: exception: ValueError: no answer parser for this format" in stop
    assert "2 steps in a row" in stop and "the run cannot learn" in stop
    assert not (tmp_path / "global_step_2").exists()  # it stopped before the step's save


@pytest.mark.e2e
def test_a_run_whose_every_step_had_only_failed_rewards_does_not_exit_0(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 steps against reward.max_failed_steps=3: the run ends before the streak limit, but
    having learnt nothing it exits 1 at its last step, naming the cause, and saves no
    checkpoint of that step."""
    spec = "test_e2e_faults:always_raises"
    extra = {"reward.functions": f'[{{name: "{spec}"}}]', "reward.max_failed_steps": 3}
    assert main(overrides(assets, tmp_path, **extra)) == 1
    err = capsys.readouterr().err.splitlines()
    (stop,) = [x for x in err if x.startswith("patrl: step 2: the reward of every one of 8")]
    assert f"{spec}: exception: ValueError: no answer parser for this format" in stop
    assert "every step of this run (2;" in stop and "reward.max_failed_steps=3" in stop
    assert not (tmp_path / "global_step_2").exists()


def test_weights_that_went_non_finite_are_never_saved(tmp_path: Path) -> None:
    from patrl.trainer import NonFiniteError, Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(), str(addition_job(tmp_path / "job") / "model"))
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteError, match="hold inf or NaN after step 0"):
        trainer.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.tmp").exists()
