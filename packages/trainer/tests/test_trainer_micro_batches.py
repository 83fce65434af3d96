"""Token-budget micro-batching."""

from __future__ import annotations

import pytest
import torch

from patrl.trainer import (
    bin_by_token_budget,
    padded_fraction,
    plan_micro_batches,
    split_across_ranks,
)


def _long_tail(n: int, seed: int) -> list[int]:
    """Response lengths with a heavy right tail (log-normal), plus a 64-token prompt."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(5.0 + 0.9 * torch.randn(n, generator=g)).clamp(4, 3000)
    return [64 + int(x) for x in lengths]


def _check_bins(lengths: list[int], bins: list[list[int]], budget: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) * max(lengths[i] for i in b) <= budget


def test_bins_respect_budget_and_cover_all_samples() -> None:
    lengths = _long_tail(200, 0)
    bins = bin_by_token_budget(lengths, 8192)
    _check_bins(lengths, bins, 8192)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_tail_padding_below_15_percent(seed: int) -> None:
    lengths = _long_tail(256, seed)
    bins = bin_by_token_budget(lengths, 8192)
    frac = padded_fraction(lengths, bins)
    # Arrival order packed into the same budget pads far more: the sort is what helps.
    naive: list[list[int]] = [[]]
    for i, n in enumerate(lengths):
        cur = naive[-1]
        if cur and (len(cur) + 1) * max(n, *(lengths[j] for j in cur)) > 8192:
            naive.append([])
        naive[-1].append(i)
    assert frac < 0.15
    assert padded_fraction(lengths, naive) > 0.4


def _brute_force_cost(lengths: list[int], budget: int, overhead: int) -> int:
    """Slow twin: try every way to cut the longest-first order into feasible bins."""
    ordered = sorted(lengths, reverse=True)
    best = None
    for mask in range(1 << (len(ordered) - 1)):
        bins, start = [], 0
        for k in range(1, len(ordered)):
            if mask >> (k - 1) & 1:
                bins.append(ordered[start:k])
                start = k
        bins.append(ordered[start:])
        if all(len(b) * b[0] <= budget for b in bins):
            cost = sum(len(b) * b[0] + overhead for b in bins)
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("overhead", [0, 7, 40, 10_000])
def test_bins_are_the_cheapest_cut_of_the_sorted_order(seed: int, overhead: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (10,), generator=g).tolist()
    bins = bin_by_token_budget(lengths, 60, overhead_tokens=overhead)
    _check_bins(lengths, bins, 60)
    got = sum(len(b) * max(lengths[i] for i in b) + overhead for b in bins)
    assert got == _brute_force_cost(lengths, 60, overhead)


def test_padded_fraction_by_hand() -> None:
    # bins [10, 5] and [3]: padded 2 * 10 + 3 = 23, real 18.
    assert padded_fraction([10, 5, 3], [[0, 1], [2]]) == pytest.approx(1 - 18 / 23)
    assert padded_fraction([], []) == 0.0


def test_sample_cap() -> None:
    bins = bin_by_token_budget([5] * 10, 1000, max_samples=3)
    assert sorted(len(b) for b in bins) == [1, 3, 3, 3]


def test_too_long_sample_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 300 tokens.*ppo_max_token_len_per_gpu=256"):
        bin_by_token_budget([100, 300, 20], 256)


def test_too_long_sample_is_named_by_its_global_index_on_several_ranks() -> None:
    with pytest.raises(ValueError, match=r"sample 3 has 99 tokens"):
        plan_micro_batches([5, 6, 7, 99, 8], 50, dp_size=2)


def test_split_across_ranks_balances_tokens() -> None:
    lengths = _long_tail(64, 3)
    shares = split_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(64))
    assert abs(loads[0] - loads[1]) <= max(lengths)


def test_plan_gives_every_rank_the_same_number_of_micro_batches() -> None:
    lengths = _long_tail(50, 4)
    plans = plan_micro_batches(lengths, 4096, dp_size=2)
    assert len(plans[0]) == len(plans[1])
    _check_bins(lengths, [b for plan in plans for b in plan if b], 4096)


def test_plan_pads_with_empty_micro_batches_when_samples_run_out() -> None:
    # Three samples that each fill the budget: rank 0 gets two bins, rank 1 one bin + one empty.
    plans = plan_micro_batches([10, 10, 10], 10, dp_size=2)
    assert plans == [[[0], [2]], [[1], []]]


def test_plan_splits_bins_before_adding_empty_ones() -> None:
    plans = plan_micro_batches([10, 10, 2, 2, 2, 2], 10, dp_size=2)
    assert [len(p) for p in plans] == [len(plans[1])] * 2
    assert all(b for p in plans for b in p)
