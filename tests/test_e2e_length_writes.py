"""The sync schedule's length predictor learns each trained response exactly once, on every
rank alike, with a static engine (the schedule reports the gathered samples) and with an
adaptive one (its controller learnt them during the rollout; the report adds nothing)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.lenpredict import read_lengths
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.length_log import LENGTH_LOG
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import learning_job_extras, tiny_job_overrides
from patrl_testkit.multirank import run_ranks
from patrl_testkit.profiles import synthetic_profile


def _run(rank: int, world_size: int, assets: Path, run_dir: Path, adaptive: bool) -> Any:
    world = World(rank, world_size, rank, torch.device("cpu"))
    profile = run_dir / "profile.json"
    if rank == 0:  # tp 2 always pays: adaptive rollouts fold
        synthetic_profile(str(assets / "model"), tp2_speedup=20.0).save(profile)
    torch.distributed.barrier()
    extra = {
        **learning_job_extras(assets),
        "rollout.adaptive_tp.enable": str(adaptive).lower(),
        "rollout.adaptive_tp.profile": profile,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 2,
    }
    config = load_config(None, tiny_job_overrides(assets, run_dir, **extra))
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    result = loop.run()
    state = loop.predictor.state_dict()
    return {"history": result.history, "lengths": state["lengths"], "prompts": state["prompts"]}


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_each_trained_response_updates_the_predictor_once(
    assets: Path, tmp_path: Path, adaptive: bool
) -> None:
    results = run_ranks(_run, world_size=2, args=(assets, tmp_path, adaptive), timeout_s=400)
    steps = [h for h in results[0]["history"] if "actor/pg_loss" in h]
    assert [h["step"] for h in steps] == [1.0, 2.0]
    if adaptive:
        assert any(h["rollout/tp_max"] == 2 for h in steps)  # learnt across a fold
    records = read_lengths(tmp_path / LENGTH_LOG)
    assert len(records) == 2 * 4 * 4  # steps x prompts x samples, every one trained
    trained = Counter(r.response_tokens for r in records)
    groups = Counter(r.prompt_id for r in records if r.sample == 0)
    for r in results:  # every rank holds the same predictor
        assert Counter(r["lengths"]) == trained
        assert {p: int(v[1]) for p, v in r["prompts"].items()} == {
            f"train/{p}": n for p, n in groups.items()
        }
    # in the same order, as every rank learns the same reports in the same order
    assert results[0]["lengths"] == results[1]["lengths"]
