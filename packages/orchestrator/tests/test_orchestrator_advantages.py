"""Advantages against hand-computed values and against a per-group loop (the slow twin)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patrl.orchestrator.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    filter_zero_variance_groups,
    grpo_advantages,
    per_token,
    refill,
    rloo_advantages,
)


def _loop_advantages(
    estimator: str, rewards: list[float], ids: list[int], norm: bool = True
) -> list[float]:
    """Obviously-correct twin: one group at a time with the statistics module."""
    out = []
    for i, r in enumerate(rewards):
        group = [rewards[j] for j in range(len(rewards)) if ids[j] == ids[i]]
        if len(group) == 1:
            out.append(0.0)
        elif estimator == "rloo":
            out.append(r - (sum(group) - r) / (len(group) - 1))
        else:
            a = r - statistics.fmean(group)
            if estimator == "grpo" and norm:
                a /= statistics.stdev(group) + 1e-6
            out.append(a)
    return out


def test_grpo_hand_computed() -> None:
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 1: rewards 0, 0, 0, 3 -> mean 0.75, unbiased std 1.5
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0]
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    s0, s1 = math.sqrt(1 / 3) + 1e-6, 1.5 + 1e-6
    expected = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0] + [-0.75 / s1] * 3 + [2.25 / s1]
    np.testing.assert_allclose(grpo_advantages(rewards, ids), expected, rtol=1e-12)


def test_grpo_without_std_and_dr_grpo_are_mean_centred() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0]
    ids = [7, 7, 7, 7, 3, 3, 3, 3]
    expected = [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]
    np.testing.assert_allclose(grpo_advantages(rewards, ids, norm_by_std=False), expected)
    np.testing.assert_allclose(dr_grpo_advantages(rewards, ids), expected)


def test_rloo_hand_computed() -> None:
    # group [1, 0, 0, 1]: sample 0 -> 1 - (0+0+1)/3 = 2/3; sample 1 -> 0 - 2/3
    # group [2, 4]: 2 - 4 = -2, 4 - 2 = 2
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0]
    ids = [0, 0, 0, 0, 1, 1]
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0]
    np.testing.assert_allclose(rloo_advantages(rewards, ids), expected, rtol=1e-12)


def test_interleaved_groups_and_singletons() -> None:
    # samples arrive out of order; group 5 has one sample -> advantage 0 everywhere
    rewards = [1.0, 3.0, 9.0, 0.0, 2.0]
    ids = [1, 2, 5, 1, 2]
    for estimator in ("grpo", "dr_grpo", "rloo"):
        adv = compute_advantages(estimator, rewards, ids)
        assert adv[2] == 0.0, estimator
    np.testing.assert_allclose(
        compute_advantages("dr_grpo", rewards, ids), [0.5, 0.5, 0, -0.5, -0.5]
    )
    np.testing.assert_allclose(compute_advantages("rloo", rewards, ids), [1.0, 1.0, 0, -1.0, -1.0])


def test_equal_rewards_give_zero_advantage() -> None:
    adv = grpo_advantages([1.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(adv, np.zeros(5))


def test_compute_advantages_dispatch_and_errors() -> None:
    rewards, ids = [1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1]
    np.testing.assert_allclose(
        compute_advantages("grpo", rewards, ids, norm_adv_by_std_in_grpo=False),
        dr_grpo_advantages(rewards, ids),
    )
    with pytest.raises(ValueError, match=r"'ppo'.*grpo, dr_grpo, rloo"):
        compute_advantages("ppo", rewards, ids)
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match=r"rewards\[1\] = nan"):
        grpo_advantages([1.0, float("nan")], [0, 0])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=30
    ),
    st.sampled_from(["grpo", "grpo_nostd", "dr_grpo", "rloo"]),
)
def test_vectorised_matches_loop(samples: list[tuple[int, float]], name: str) -> None:
    ids = [g for g, _ in samples]
    rewards = [r for _, r in samples]
    estimator, norm = ("grpo", False) if name == "grpo_nostd" else (name, True)
    fast = compute_advantages(estimator, rewards, ids, norm_adv_by_std_in_grpo=norm)
    slow = _loop_advantages(estimator, rewards, ids, norm)
    np.testing.assert_allclose(fast, slow, rtol=1e-9, atol=1e-9)


def test_per_token_broadcast() -> None:
    out = per_token([0.5, -1.0, 2.0], [3, 1, 0])
    assert [a.tolist() for a in out] == [[0.5, 0.5, 0.5], [-1.0], []]
    with pytest.raises(ValueError, match="one scalar per response"):
        per_token([0.5, 1.0], [3])
    with pytest.raises(ValueError, match=r"response_lengths\[0\] = -1"):
        per_token([0.5], [-1])


def test_filter_zero_variance_groups() -> None:
    # group "a": all 1 (solved) -> dropped; "b": mixed -> kept; "c": all 0 -> dropped;
    # "d": a single sample -> dropped; "e": mixed -> kept
    ids = ["b", "a", "b", "a", "c", "c", "d", "e", "e"]
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.2, 0.3]
    f = filter_zero_variance_groups(rewards, ids)
    assert f.kept_groups == ["b", "e"]
    assert f.dropped_groups == ["a", "c", "d"]
    assert (f.num_kept, f.num_dropped) == (2, 3)
    assert f.keep.tolist() == [True, False, True, False, False, False, False, True, True]


def test_refill_loop_reaches_the_target() -> None:
    target = 4
    rounds = [["g0", "g1"], [], ["g2"], ["g3", "g4", "g5"]]
    kept: list[str] = []
    draws = 0
    for new_groups in rounds:
        draws += 1
        kept += new_groups
        r = refill(kept, target)
        if not r.draw_more:
            break
    assert draws == 4
    assert r.groups == ["g0", "g1", "g2", "g3"]
    assert r.num_surplus == 2
    short = refill(["g0"], target)
    assert short.draw_more and short.groups == ["g0"] and short.num_surplus == 0
    with pytest.raises(ValueError, match="target must be >= 1"):
        refill([], 0)


def _gae_twin(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    adv, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        adv[t], next_value = running, values[t]
    return adv


def test_gae_advantages_are_whitened_over_every_token_of_the_batch() -> None:
    """verl's masked_whiten over the batch's response tokens (unbiased variance), responses of
    different lengths including one token; returns are the unwhitened advantages + values."""
    from patrl.orchestrator.advantages import gae_advantages

    rng = np.random.default_rng(0)
    lengths = [5, 1, 3]
    values = [rng.normal(size=n) for n in lengths]
    rewards = [np.r_[np.zeros(n - 1), rng.uniform()] for n in lengths]
    adv, ret = gae_advantages(rewards, values, gamma=0.99, lam=0.95)
    raw = [_gae_twin(list(r), list(v), 0.99, 0.95) for r, v in zip(rewards, values, strict=True)]
    flat = np.concatenate(raw)
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + 1e-8)
    for a, r, v, want in zip(adv, ret, values, raw, strict=True):
        np.testing.assert_allclose(a, (np.array(want) - mean) / std, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(r, np.array(want) + v, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.concatenate(adv).std(ddof=1), 1.0, rtol=1e-6)
    one, _ = gae_advantages([np.array([1.0])], [np.array([0.25])], gamma=1.0, lam=1.0)
    assert one[0].tolist() == [0.0]  # one token: only centred (verl would divide by zero)
    with pytest.raises(ValueError, match="one entry per response token"):
        gae_advantages([np.zeros(2)], [np.zeros(3)], gamma=1.0, lam=1.0)
