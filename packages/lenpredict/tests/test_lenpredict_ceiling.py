"""`adaptive_ceiling`: the best any adaptive policy can do against the better static layout."""

import numpy as np
import pytest
from lenpredict_cases import compute_bound, flat, profile_from, tp_speeds_up

from patrl.lenpredict import LatencyModel, Layout, adaptive_ceiling
from patrl.lenpredict.ceiling import step_times

WIDE, NARROW = Layout(2, 1), Layout(1, 2)
CONTEXT = 300.0


def model(step) -> LatencyModel:
    return LatencyModel.fit(profile_from(step, tp_sizes=(1, 2), num_devices=2))


def ratio_of(latency: LatencyModel, steps_at: np.ndarray) -> float:
    """Slow twin: ideal adaptive / best static for a workload of `steps_at[b - 1]` steps at
    batch b, summed step by step."""
    adaptive = wide = narrow = 0.0
    for b, k in enumerate(steps_at, start=1):
        w = float(latency.step_time(1, -(-b // 2), -(-b // 2) * CONTEXT, CONTEXT))
        n = float(latency.step_time(2, b, b * CONTEXT, CONTEXT))
        adaptive, wide, narrow = adaptive + k * min(w, n), wide + k * w, narrow + k * n
    return adaptive / min(wide, narrow)


@pytest.mark.parametrize("step", [flat, tp_speeds_up])
def test_no_crossover_no_gain(step):
    ceiling = adaptive_ceiling(model(step), WIDE, NARROW, 64, CONTEXT)
    assert ceiling.ratio == 1.0
    assert (ceiling.wide_batch, ceiling.narrow_batch) == (0, 0)


def test_crossover_ceiling_is_attained_and_never_beaten():
    latency = model(compute_bound)
    ceiling = adaptive_ceiling(latency, WIDE, NARROW, 64, CONTEXT)
    # compute_bound: tp 2 wins a step of 1 sequence, two tp-1 replicas win large batches
    assert ceiling.narrow_batch < ceiling.wide_batch
    assert 0.5 < ceiling.ratio < 0.95
    # the workload it names attains it (both statics tie there) ...
    steps_at = np.zeros(64)
    steps_at[ceiling.wide_batch - 1] = ceiling.wide_share
    steps_at[ceiling.narrow_batch - 1] = 1 - ceiling.wide_share
    assert ratio_of(latency, steps_at) == pytest.approx(ceiling.ratio, rel=1e-9)
    w, n = (
        step_times(latency, lay, np.arange(1, 65), CONTEXT) @ steps_at for lay in (WIDE, NARROW)
    )
    assert w == pytest.approx(n, rel=1e-9)
    # ... and no other workload does better: random mixtures, and every pair of batch sizes
    rng = np.random.default_rng(0)
    for _ in range(200):
        steps_at = rng.dirichlet(np.full(64, rng.choice([0.05, 1.0])))
        assert ratio_of(latency, steps_at) >= ceiling.ratio - 1e-12
    # every two-batch workload on a grid of shares, vectorised (rows: workloads)
    batches = np.arange(1, 65)
    w, n = (step_times(latency, lay, batches, CONTEXT) for lay in (WIDE, NARROW))
    share = np.linspace(0, 1, 101)[:, None, None]
    at = lambda t: share * t[:, None] + (1 - share) * t[None, :]  # noqa: E731
    ratios = at(np.minimum(w, n)) / np.minimum(at(w), at(n))
    assert ratios.min() >= ceiling.ratio - 1e-12
    assert ratios.min() == pytest.approx(ceiling.ratio, rel=2e-3)


def test_bad_arguments():
    latency = model(compute_bound)
    with pytest.raises(ValueError, match="max_batch=0"):
        adaptive_ceiling(latency, WIDE, NARROW, 0, CONTEXT)
    with pytest.raises(ValueError, match="different numbers of ranks"):
        adaptive_ceiling(latency, WIDE, Layout(1, 1), 8, CONTEXT)
