"""verl's validation metrics (`patrl.orchestrator.val_metrics`): names and sections as verl's
trainer logs them, per-prompt statistics averaged over a source's prompts, bootstrapped
best/worst-of-k against their closed forms, and reward extras as variables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from patrl.orchestrator.scoring import Sample
from patrl.orchestrator.val_metrics import (
    bootstrap,
    prompt_metrics,
    subset_sizes,
    validation_source_metrics,
)


def _sample(prompt: int, reward: float, **extras: float) -> Sample:
    return Sample(prompt, [1], [2], [-0.1], "stop", reward, extras=dict(extras))


def test_subset_sizes_are_verls_powers_of_two_then_n() -> None:
    assert subset_sizes(2) == [2]
    assert subset_sizes(3) == [2, 3]
    assert subset_sizes(8) == [2, 4, 8]
    assert subset_sizes(10) == [2, 4, 8, 10]


def test_one_response_a_prompt_gives_mean_at_1_only_under_val_core() -> None:
    samples = [_sample(0, 1.0), _sample(1, 0.0), _sample(2, 1.0)]
    got = validation_source_metrics(samples, {0: "gsm8k", 1: "gsm8k"})
    assert got == {
        "val-core/gsm8k/reward/mean@1": 0.5,  # prompts 0 and 1
        "val-core/unknown/reward/mean@1": 1.0,  # prompt 2 has no data_source
    }


def test_sections_follow_verl_core_variable_and_largest_k() -> None:
    samples = [_sample(p, float(r)) for p in range(3) for r in (p % 2, 1, 0, 1)]
    got = validation_source_metrics(samples, {})
    core = {k for k in got if k.startswith("val-core/")}
    assert core == {
        "val-core/unknown/reward/mean@4",
        "val-core/unknown/reward/best@4/mean",
        "val-core/unknown/reward/best@4/std",  # verl: a best@N name at the largest N is core
    }
    aux = {k.removeprefix("val-aux/unknown/reward/") for k in got if k.startswith("val-aux/")}
    assert aux == {
        "std@4",
        "best@2/mean",
        "best@2/std",
        "worst@2/mean",
        "worst@2/std",
        "worst@4/mean",
        "worst@4/std",
    }


def test_per_prompt_statistics_are_averaged_over_prompts() -> None:
    # prompt 0: two of four right; prompt 1: all right; prompt 2 (another source): none
    rewards = {0: [1, 0, 1, 0], 1: [1, 1, 1, 1], 2: [0, 0, 0, 0]}
    samples = [_sample(p, float(r)) for p, rs in rewards.items() for r in rs]
    got = validation_source_metrics(samples, {0: "math", 1: "math", 2: "code"})
    assert got["val-core/math/reward/mean@4"] == pytest.approx(0.75)
    assert got["val-aux/math/reward/std@4"] == pytest.approx((0.5 + 0.0) / 2)
    assert got["val-core/code/reward/mean@4"] == 0.0
    assert got["val-core/code/reward/best@4/mean"] == 0.0  # nothing right, at any k
    # prompt 1 is right whatever is drawn: its best and worst are 1
    one = prompt_metrics([1.0] * 4)
    assert one["best@4/mean"] == one["worst@4/mean"] == 1.0 and one["best@4/std"] == 0.0


def test_bootstrapped_best_and_worst_of_k_match_their_closed_forms() -> None:
    """Drawing k of n responses with replacement, a prompt with c of n right has best-of-k
    1 - (1 - c/n)^k and worst-of-k (c/n)^k in expectation; 1000 draws estimate each with a
    standard error below 0.016, so 0.05 is over three of them."""
    values = [1.0] * 3 + [0.0] * 5  # c/n = 3/8
    got = prompt_metrics(values)
    p = 3 / 8
    for k in (2, 4, 8):
        assert got[f"best@{k}/mean"] == pytest.approx(1 - (1 - p) ** k, abs=0.05)
        assert got[f"worst@{k}/mean"] == pytest.approx(p**k, abs=0.05)
    assert got["mean@8"] == pytest.approx(p) and got["std@8"] == pytest.approx(np.std(values))


def test_bootstrap_is_seeded_and_leaves_numpys_global_generator_alone() -> None:
    np.random.seed(7)
    before = np.random.get_state()[1].copy()  # type: ignore[index]
    a = bootstrap([0.0, 1.0, 0.5], 2, [np.max], seed=42)
    assert np.array_equal(np.random.get_state()[1], before)  # type: ignore[index]
    assert bootstrap([0.0, 1.0, 0.5], 2, [np.max], seed=42) == a
    assert bootstrap([0.0, 1.0, 0.5], 2, [np.max], seed=1) != a


def test_reward_extras_are_variables_and_acc_becomes_the_core_one() -> None:
    samples = [
        _sample(0, 0.9, **{"compute_score/acc": 1.0, "compute_score/len": 3.0}),
        _sample(0, 0.1, **{"compute_score/acc": 0.0}),  # no "len": left out of its mean
        _sample(1, 0.5, **{"compute_score/acc": 1.0, "compute_score/len": math.nan}),
        _sample(1, 0.5, **{"compute_score/acc": 1.0}),
    ]
    got = validation_source_metrics(samples, {})
    assert got["val-core/unknown/acc/mean@2"] == pytest.approx(0.75)  # (0.5 + 1) / 2
    assert got["val-aux/unknown/reward/mean@2"] == pytest.approx(0.5)  # (0.5 + 0.5) / 2
    assert got["val-aux/unknown/len/mean@1"] == 3.0  # prompt 0's one value; prompt 1 has none
    assert not any(k.startswith("val-core/unknown/reward") for k in got)


def test_an_extra_named_reward_keeps_its_function_name_beside_the_total() -> None:
    samples = [_sample(0, 0.25, **{"f/reward": 0.9})]
    got = validation_source_metrics(samples, {})
    assert got["val-core/unknown/reward/mean@1"] == 0.25  # the total, not f's entry
    assert got["val-aux/unknown/f/reward/mean@1"] == 0.9


def _verls_bootstrap(
    values: list[float], k: int, seed: int = 42, rounds: int = 1000
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The slow twin: verl's `bootstrap_metric` as its trainer runs it (numpy's global
    generator seeded, one subset of k indices drawn with replacement a round, max and min
    of it), written out here; the global state is restored after."""
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        best, worst = [], []
        for _ in range(rounds):
            idx = np.random.choice(len(values), size=k, replace=True)
            subset = [values[i] for i in idx]
            best.append(np.max(subset))
            worst.append(np.min(subset))
    finally:
        np.random.set_state(state)
    return (float(np.mean(best)), float(np.std(best))), (
        float(np.mean(worst)),
        float(np.std(worst)),
    )


def test_best_and_worst_of_k_equal_verls_bootstrap_draw_for_draw() -> None:
    """A local RandomState(seed) draws what verl's seeded global generator draws, so the
    bootstrapped numbers equal verl's (up to float summation order)."""
    values = [0.0, 1.0, 0.5, 1.0, 0.0, 0.25, 1.0]
    got = prompt_metrics(values)
    for k in subset_sizes(len(values)):
        (best, best_sd), (worst, worst_sd) = _verls_bootstrap(values, k)
        assert got[f"best@{k}/mean"] == pytest.approx(best, abs=1e-12)
        assert got[f"best@{k}/std"] == pytest.approx(best_sd, abs=1e-12)
        assert got[f"worst@{k}/mean"] == pytest.approx(worst, abs=1e-12)
        assert got[f"worst@{k}/std"] == pytest.approx(worst_sd, abs=1e-12)


def test_two_functions_with_one_key_keep_their_function_names() -> None:
    samples = [_sample(0, 1.0, **{"f/acc": 1.0, "g/acc": 0.0})]
    got = validation_source_metrics(samples, {})
    assert got["val-aux/unknown/f/acc/mean@1"] == 1.0
    assert got["val-aux/unknown/g/acc/mean@1"] == 0.0
    assert got["val-core/unknown/reward/mean@1"] == 1.0  # no variable named "acc" alone
