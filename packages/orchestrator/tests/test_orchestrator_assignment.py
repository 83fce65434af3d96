"""Length-aware prompt assignment at the start of a rollout, as the GRPO loop does it: the
predictor's expected length of each prompt x its n samples, longest first onto the least
loaded replica; a prompt's samples stay on one replica."""

from __future__ import annotations

import numpy as np

from patrl.lenpredict import LengthPredictor, assign_prompts


def _imbalance(replica_of: list[int], work: np.ndarray, replicas: int) -> float:
    load = np.bincount(replica_of, weights=work, minlength=replicas)
    return float(load.max() / load.mean() - 1)


def test_lpt_balances_a_skewed_prompt_set_where_round_robin_does_not() -> None:
    rng = np.random.default_rng(0)
    # every other prompt is long: round robin puts all of them on replica 0
    true = np.where(np.arange(16) % 2 == 0, 400.0, 20.0) * rng.uniform(0.8, 1.2, 16)
    n = 8
    predictor = LengthPredictor()
    for step in range(3):  # three earlier rollouts of the same prompts
        for p, length in enumerate(true):
            group = f"{step}:{p}"
            predictor.start_group(group, f"train/{p}", n)
            for i, sample in enumerate(rng.normal(length, 0.1 * length, n)):
                predictor.observe_finished(f"{group}:{i}", group, max(1, int(sample)))
    predicted = [predictor.expected_length(f"train/{p}") for p in range(16)]
    work = true * n
    lpt = assign_prompts(predicted, [n] * 16, 2, "lpt")
    rr = assign_prompts(predicted, [n] * 16, 2, "round_robin")
    assert _imbalance(rr, work, 2) > 0.30
    assert _imbalance(lpt, work, 2) < 0.10
    assert len(lpt) == 16 and set(lpt) == {0, 1}  # one replica per prompt group, both used
