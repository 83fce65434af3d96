"""verl's recipes in a real (tiny) job: truncated IS engages when the engine's logprobs are
off, and verl's DAPO command line resolves to the same values."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import addition_job, tiny_job_overrides

SHIFT = 1.0  # subtracted from every engine logprob of the perturbed step


def digit_reward(response: str, answer: str, **meta: Any) -> float:
    """Dense, so a random model's advantages are not all 0."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return addition_job(tmp_path_factory.mktemp("e2e_recipes"))


def _run(assets: Path, run_dir: Path, steps: int, **extra: Any) -> list[dict[str, float]]:
    """A tiny job whose first training rollout's engine logprobs are lowered by SHIFT (a
    wrapper around the loop's generation: the engine itself is untouched)."""
    extra = {
        "reward.functions": '[{name: "test_e2e_recipes:digit_reward"}]',
        "trainer.total_training_steps": steps,
        "trainer.save_freq": -1,
        **extra,
    }
    config = load_config(None, tiny_job_overrides(assets, run_dir, **extra))
    loop = SyncGRPO(
        config,
        World(0, 1, 0, torch.device("cpu")),
        str(assets / "model"),
        config.data.train_files,
        None,
    )
    generate = loop._generate
    calls: list[int] = []

    def perturbed(items: Any, *args: Any, **kwargs: Any) -> Any:
        out = generate(items, *args, **kwargs)
        if kwargs.get("split", "train") != "train":
            return out
        calls.append(loop.step)
        if len(calls) == 1:  # the first step's rollout only
            for _, request in out:
                for completion in request.outputs:
                    completion.logprobs = [lp - SHIFT for lp in completion.logprobs]
        return out

    loop._generate = perturbed  # type: ignore[method-assign]
    return [h for h in loop.run().history if "critic/score/mean" in h]


@pytest.mark.e2e
def test_tis_engages_when_the_engine_logprobs_are_perturbed(assets: Path, tmp_path: Path) -> None:
    """Token TIS at threshold 2. Step 1's engine logprobs are lowered by 1.0 on purpose, so
    pi_train / pi_rollout = e > 2 on every token: the KL metric reads -1, the weights' mean e
    (verl's metric is taken before truncation), and every weight is truncated to 2, so the
    policy gradient is exactly twice that of the same step without correction (same seed,
    same samples, same old logprobs): grad_norm (before clipping) doubles. Step 2 is
    unperturbed: KL ~ 0, weights ~ 1."""
    tis = {
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    }
    first, second = _run(assets, tmp_path / "tis", 2, **tis)
    (plain,) = _run(assets, tmp_path / "plain", 1)
    assert first["critic/score/mean"] == plain["critic/score/mean"]  # the same samples
    assert first["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-3)
    assert plain["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-3)  # measured, uncorrected
    assert "rollout_corr/rollout_is_mean" not in plain
    assert first["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(math.e, rel=1e-3)
    assert plain["actor/grad_norm"] > 0
    assert first["actor/grad_norm"] == pytest.approx(2.0 * plain["actor/grad_norm"], rel=1e-4)
    assert abs(second["rollout_corr/kl"]) < 1e-3
    assert second["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
