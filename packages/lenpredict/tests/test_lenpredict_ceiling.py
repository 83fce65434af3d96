"""`adaptive_ceiling`: the best any adaptive policy can do against the better static layout."""

import numpy as np
import pytest
from lenpredict_testkit import compute_bound, flat, tp_speeds_up

from patrl.lenpredict import LatencyModel, Layout, adaptive_ceiling, lockstep_free_switch
from patrl.lenpredict.ceiling import step_times
from patrl_testkit.profiles import profile_from

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


def naive_free_switch(latency, wide, narrow, lengths, prompts, replica):
    """Slow twin of `lockstep_free_switch`: step by step, replica by replica, sample by sample."""
    merge = wide.dp // narrow.dp
    totals = {"wide": 0.0, "narrow": 0.0, "free": 0.0}
    for s in range(1, max(lengths)):
        per_layout = []
        for layout, of in ((wide, list(replica)), (narrow, [r // merge for r in replica])):
            worst = 0.0
            for r in range(layout.dp):
                alive = [i for i in range(len(lengths)) if of[i] == r and lengths[i] > s]
                if alive:
                    context = sum(prompts[i] + s for i in alive)
                    longest = max(prompts[i] + s for i in alive)
                    t = float(latency.step_time(layout.tp, len(alive), context, longest))
                    worst = max(worst, t)
            per_layout.append(worst)
        totals["wide"] += per_layout[0]
        totals["narrow"] += per_layout[1]
        totals["free"] += min(per_layout)
    return totals


@pytest.mark.parametrize("padded", [False, True])
def test_lockstep_free_switch_matches_a_step_by_step_count(padded):
    step = compute_bound
    profile = profile_from(
        step,
        padded=(lambda tp, b, c, m: step(tp, b, c) + 2e-7 * b * m / tp) if padded else None,
        tp_sizes=(1, 2, 4),
        num_devices=4,
    )
    latency = LatencyModel.fit(profile)
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(20, 60, 160), rng.integers(100, 200, 3), [1]])
    prompts = rng.integers(8, 200, len(lengths))
    for wide, narrow in ((Layout(4, 1), Layout(2, 2)), (Layout(4, 1), Layout(1, 4))):
        replica = rng.integers(0, wide.dp, len(lengths))
        fast = lockstep_free_switch(latency, wide, narrow, lengths, prompts, replica)
        slow = naive_free_switch(latency, wide, narrow, lengths, prompts, replica)
        assert fast.wide_s == pytest.approx(slow["wide"], rel=1e-9)
        assert fast.narrow_s == pytest.approx(slow["narrow"], rel=1e-9)
        assert fast.free_s == pytest.approx(slow["free"], rel=1e-9)
        # a long tail on a crossover: the bulk wide, the tail narrow, both beaten
        assert fast.free_s < min(fast.wide_s, fast.narrow_s) and fast.ratio < 0.99


@pytest.mark.parametrize("step", [flat, tp_speeds_up])
def test_free_switching_gains_nothing_without_a_crossover(step):
    lengths = np.array([5, 9, 40, 200])
    bound = lockstep_free_switch(model(step), WIDE, NARROW, lengths, np.full(4, 16), [0, 1, 0, 1])
    assert bound.ratio == pytest.approx(1.0)


def test_nothing_to_decode_gains_nothing():
    ones = lockstep_free_switch(model(compute_bound), WIDE, NARROW, [1, 1], [4, 4], [0, 1])
    assert (ones.wide_s, ones.narrow_s, ones.free_s, ones.ratio) == (0.0, 0.0, 0.0, 1.0)


def test_lockstep_free_switch_bad_arguments():
    latency = model(compute_bound)
    with pytest.raises(ValueError, match="does not merge"):
        lockstep_free_switch(latency, NARROW, WIDE, [3], [4], [0])
    with pytest.raises(ValueError, match="one entry per sample"):
        lockstep_free_switch(latency, WIDE, NARROW, [3, 4], [4], [0, 1])
    with pytest.raises(ValueError, match=r"replica indices must lie in \[0, 2\)"):
        lockstep_free_switch(latency, WIDE, NARROW, [3], [4], [2])
