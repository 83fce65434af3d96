"""Finish times as the longest of independent samples: the Monte Carlo draws against their
slow twins (the quantiles they are drawn from; the exact expectation of one replica's finish
by numerical integration of its order statistic), and what the planner makes of them."""

from __future__ import annotations

import numpy as np
import pytest
from lenpredict_testkit import tp_speeds_up

from patrl.lenpredict import LatencyModel, Layout, PlannerConfig, ReconfigPlanner, RunningSet
from patrl.lenpredict.finish_time import Questions, independent_draws, slowest_replica_times
from patrl.lenpredict.latency_model import StepCoefficients
from patrl_testkit.profiles import profile_from

LEVELS = np.array([0.1, 0.5, 0.9])


def quantile_function(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Slow twin of `independent_draws`' law for one sequence of quantiles `q` at LEVELS: u
    in (0, 1) -> length, written out case by case."""
    out = []
    for x in u:
        if x < LEVELS[0]:
            theta = max(q[1] - q[0], 1.0) / np.log(LEVELS[1] / LEVELS[0])
            value = q[0] + theta * np.log(x / LEVELS[0])
        elif x > LEVELS[-1]:
            theta = max(q[-1] - q[-2], 1.0) / np.log((1 - LEVELS[-2]) / (1 - LEVELS[-1]))
            value = q[-1] + theta * np.log((1 - LEVELS[-1]) / (1 - x))
        else:
            value = float(np.interp(x, LEVELS, q))
        out.append(max(value, 1.0))
    return np.array(out)


def test_draws_follow_the_quantiles_they_come_from() -> None:
    q = np.array([[100.0, 400.0, 1500.0], [10.0, 20.0, 30.0]])
    draws = independent_draws(q, LEVELS, 40_000, np.random.default_rng(0))
    for row, quantiles in zip(draws, q, strict=True):
        np.testing.assert_allclose(np.quantile(row, LEVELS), quantiles, rtol=0.05)
    # tails beyond the outer quantiles, as the slow twin puts them
    u = np.array([0.95, 0.99])
    np.testing.assert_allclose(np.quantile(draws[0], u), quantile_function(q[0], u), rtol=0.05)
    # a cap bounds every draw; nothing is drawn below one token
    capped = independent_draws(q, LEVELS, 1000, np.random.default_rng(1), np.array([800.0, 5.0]))
    assert capped[0].max() == 800.0 and capped[1].max() == 5.0 and capped.min() >= 1.0


def test_refuses_columns_that_do_not_match_the_levels() -> None:
    with pytest.raises(ValueError, match="levels"):
        independent_draws(np.ones((2, 2)), LEVELS, 4, np.random.default_rng(0))


def test_monte_carlo_finish_matches_the_exact_order_statistic() -> None:
    """One replica, a linear step t = a + b·B + c·C: its finish is a·max_i R_i + b·Σ R_i +
    c·Σ R_i·(ctx_i + (R_i − 1)/2), so its expectation over independent R_i is a·E[max R] +
    Σ (b·E[R_i] + c·(ctx_i·E[R_i] + (E[R_i²] − E[R_i])/2)), with E[max R] = ∫ 1 − Π F_i(x) dx.
    The Monte Carlo mean must converge to it."""
    rng = np.random.default_rng(0)
    n = 12
    median = rng.uniform(200, 2000, n)
    q = np.stack([median * 0.5, median, median * 2.5], axis=1)
    context = rng.integers(50, 500, n).astype(float)
    a, b, c = 3e-3, 2e-5, 1e-8
    coefficients = {1: StepCoefficients(a, b, c, 0.0, (), ())}
    draws = 20_000
    sampled = independent_draws(q, LEVELS, draws, np.random.default_rng(1))
    running = RunningSet(np.arange(n), np.zeros(n, dtype=int), context, sampled)
    rows = Questions()
    for col in range(draws):
        rows.add(0, col, False, np.inf, Layout(1, 1))
    monte_carlo = slowest_replica_times(rows, np.zeros((1, n), dtype=int), running, coefficients)

    u = (np.arange(40_000) + 0.5) / 40_000  # midpoint rule over the quantile function
    lengths = np.stack([quantile_function(row, u[::10]) for row in q])  # coarse for the CDF
    fine = [quantile_function(row, u) for row in q]
    mean = np.array([x.mean() for x in fine])
    second = np.array([(x * x).mean() for x in fine])
    grid = np.linspace(0.0, lengths.max() * 1.2, 20_000)
    cdf = np.stack([np.interp(grid, x, u[::10], left=0.0, right=1.0) for x in lengths])
    expected_max = float(np.sum(1 - cdf.prod(axis=0)) * (grid[1] - grid[0]))
    exact = a * expected_max + float(np.sum(b * mean + c * (context * mean + (second - mean) / 2)))
    assert monte_carlo.mean() == pytest.approx(exact, rel=0.01)
    # and the longest of independent samples lies well above the median scenario's
    assert expected_max > 1.3 * q[:, 1].max()


def _latency() -> LatencyModel:
    return LatencyModel.fit(profile_from(tp_speeds_up, tp_sizes=(1, 2)))


def test_planner_prices_the_longest_of_independent_samples() -> None:
    """Many sequences with the same wide spread: a replica finishes with the longest of them,
    which the comonotone scenarios never put above each one's 90th percentile."""
    n = 64
    q = np.tile([100.0, 500.0, 2500.0], (n, 1))
    running = RunningSet(np.arange(n), np.arange(n) % 2, np.full(n, 100.0), q)
    latency = _latency()
    comonotone = ReconfigPlanner(latency, 2, PlannerConfig(candidate_tp=(1, 2)))
    independent = ReconfigPlanner(
        latency, 2, PlannerConfig(candidate_tp=(1, 2), finish_time="independent", draws=64)
    )
    stay_q = comonotone.decide(running, Layout(2, 1)).options[0].run_s
    stay_i = independent.decide(running, Layout(2, 1)).options[0].run_s
    assert stay_i > stay_q
    # deterministic for a seed: the same call on a fresh planner prices the same
    again = ReconfigPlanner(
        latency, 2, PlannerConfig(candidate_tp=(1, 2), finish_time="independent", draws=64)
    )
    assert again.decide(running, Layout(2, 1)).options[0].run_s == stay_i


def test_one_column_is_exact_and_stays_deterministic() -> None:
    """With the true lengths (one column) there is nothing to draw: both modes agree."""
    n = 8
    running = RunningSet(
        np.arange(n), np.arange(n) % 2, np.full(n, 50.0), np.arange(1.0, n + 1)[:, None] * 100
    )
    latency = _latency()
    a = ReconfigPlanner(latency, 2, PlannerConfig(candidate_tp=(1, 2))).decide(
        running, Layout(2, 1)
    )
    b = ReconfigPlanner(
        latency, 2, PlannerConfig(candidate_tp=(1, 2), finish_time="independent")
    ).decide(running, Layout(2, 1))
    assert [o.run_s for o in a.options] == [o.run_s for o in b.options]
    assert a.action == b.action


def test_independent_needs_levels_for_every_column() -> None:
    running = RunningSet(np.arange(2), np.zeros(2, dtype=int), np.ones(2), np.ones((2, 4)))
    planner = ReconfigPlanner(
        _latency(), 2, PlannerConfig(candidate_tp=(1, 2), finish_time="independent")
    )
    with pytest.raises(ValueError, match="quantile_levels"):
        planner.decide(running, Layout(2, 1))
