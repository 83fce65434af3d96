"""Token-budget micro-batching: which samples go to which rank and into which micro-batch.

A right-padded micro-batch costs `samples * longest` tokens; `max_tokens`
(`ppo_max_token_len_per_gpu`) bounds that product. Samples are cut longest first into bins of
similar length. Every rank runs the same number of micro-batches (FSDP's collectives run in
each forward and backward): ranks with fewer bins split their fullest ones, and a rank with too
few samples gets empty micro-batches (run with zero loss weight). See docs/training.md.
"""

from __future__ import annotations

from collections.abc import Sequence


def bin_by_token_budget(
    lengths: Sequence[int],
    max_tokens: int,
    max_samples: int | None = None,
    overhead_tokens: int | None = None,
) -> list[list[int]]:
    """Indices of `lengths` grouped so that `len(bin) * max(bin lengths) <= max_tokens`.

    Of the cuts of the longest-first order into such bins, the one minimising
    `padded tokens + overhead_tokens * bins`. `overhead_tokens` prices one more micro-batch's
    fixed cost in tokens of padding (default `max_tokens // 8`): 0 gives every sample its own
    bin, a very large value packs as few bins as possible.
    """
    check_fits(lengths, max_tokens)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"ppo_micro_batch_size_per_gpu must be >= 1, got {max_samples}")
    overhead = max_tokens // 8 if overhead_tokens is None else overhead_tokens
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    # cost[i]: cheapest packing of order[i:]; a bin order[i:j] costs (j - i) * its first length.
    cost = [0] * (n + 1)
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        longest = lengths[order[i]]
        most = max_tokens // longest
        if max_samples is not None:
            most = min(most, max_samples)
        cost[i] = -1
        for j in range(i + 1, min(n, i + most) + 1):
            c = (j - i) * longest + overhead + cost[j]
            if cost[i] < 0 or c < cost[i]:
                cost[i], cut[i] = c, j
    bins, i = [], 0
    while i < n:
        bins.append(order[i : cut[i]])
        i = cut[i]
    return bins


def check_fits(lengths: Sequence[int], max_tokens: int) -> None:
    """Every sample must fit a micro-batch on its own; name the first that does not."""
    if max_tokens < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu must be >= 1, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sample {i} has {n} tokens, more than ppo_max_token_len_per_gpu={max_tokens} "
            f"({len(too_long)} sample(s) too long); raise the budget or drop/truncate them"
        )


def split_across_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Longest-processing-time assignment: each sample, longest first, to the lightest rank."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, dp_size: int = 1, max_samples: int | None = None
) -> list[list[list[int]]]:
    """Per rank, its micro-batches (global sample indices); every rank gets the same count."""
    check_fits(lengths, max_tokens)  # here, so that errors name the global sample index
    plans = []
    for share in split_across_ranks(lengths, dp_size):
        bins = bin_by_token_budget([lengths[i] for i in share], max_tokens, max_samples)
        plans.append([[share[j] for j in b] for b in bins])
    target = max(len(p) for p in plans)
    for bins in plans:
        while len(bins) < target:
            _split_fullest(bins)
    return plans


def _split_fullest(bins: list[list[int]]) -> None:
    fullest = max(range(len(bins)), key=lambda b: len(bins[b])) if bins else None
    if fullest is None or len(bins[fullest]) < 2:
        bins.append([])
        return
    b = bins[fullest]
    half = len(b) // 2
    bins[fullest] = b[:half]
    bins.insert(fullest + 1, b[half:])


def padded_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> float:
    """Share of the padded tokens of `micro_batches` that are padding."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb)
    return 0.0 if padded == 0 else 1.0 - real / padded
