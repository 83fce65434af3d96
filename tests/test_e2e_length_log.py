"""A one-process GRPO run leaves what `python -m patrl.lenpredict.simulate` needs: its length
log and a TP-1 latency profile, read as is; a resumed run's log holds each step once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.lenpredict import Profile, read_lengths
from patrl.lenpredict.simulate import main as simulate
from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.length_log import LENGTH_LOG
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import addition_job


def run(assets: Path, out: Path, steps: int, **extra: object) -> Path:
    values = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 16,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 4,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 128,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": steps,
        "trainer.save_freq": 2,
        "trainer.test_freq": 0,
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": out,
        **extra,
    }
    config = load_config(None, [f"{k}={v}" for k, v in values.items()])
    world = World(0, 1, 0, torch.device("cpu"))
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    loop.run()
    return config.run_dir


@pytest.mark.e2e
def test_one_process_run_writes_what_simulate_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path / "cache"))
    assets = addition_job(tmp_path / "assets")
    run_dir = run(assets, tmp_path / "out", steps=3)
    records = read_lengths(run_dir / LENGTH_LOG)
    assert sorted({r.step for r in records}) == [1, 2, 3]
    assert all(sum(r.step == s for r in records) == 16 for s in (1, 2, 3))  # 4 prompts x 4
    assert {r.finish_reason for r in records} <= {"stop", "length"}
    assert all(1 <= r.response_tokens <= 16 for r in records)
    profile = Profile.load(run_dir / "profile.json")
    assert profile.source == "measured" and profile.tp_sizes == [1]

    argv = ["--profile", str(run_dir / "profile.json"), "--lengths", str(run_dir / LENGTH_LOG)]
    assert simulate(argv) == 0
    assert "48 samples in 3 rollout(s)" in capsys.readouterr().out
    assert simulate([*argv, "--sweep-gpus", "1,2,4", "--lengths-known", "predicted"]) == 0
    assert "sweet spot, static TP only" in capsys.readouterr().out

    # resumed from step 2 and run to 4: steps 3 and 4 are redone, each logged once
    step3 = [r for r in records if r.step == 3]
    resumed = {
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": run_checkpoint.step_dir(run_dir, 2),
    }
    run(assets, tmp_path / "out", steps=4, **resumed)
    again = read_lengths(run_dir / LENGTH_LOG)
    assert [sum(r.step == s for r in again) for s in (1, 2, 3, 4)] == [16, 16, 16, 16]
    assert [r for r in again if r.step <= 2] == [r for r in records if r.step <= 2]
    assert [r for r in again if r.step == 3] == step3  # the same prompts and seeds
