"""Token-budget micro-batching: which samples go to which rank and into which micro-batch.

A micro-batch is right-padded to its longest sample, so what it costs in memory is
`samples * longest` padded tokens; that product is what `max_tokens`
(`ppo_max_token_len_per_gpu`) bounds. Samples are sorted longest first and binned greedily,
so each bin holds samples of similar length and padding stays small even on a long-tail batch.

Data-parallel ranks run FSDP collectives in every forward and backward, so every rank must run
the same number of micro-batches: ranks with fewer bins split their fullest ones, and a rank
with too few samples gets empty micro-batches (the trainer runs them with zero loss weight).
"""

from __future__ import annotations

from collections.abc import Sequence


def bin_by_token_budget(
    lengths: Sequence[int], max_tokens: int, max_samples: int | None = None
) -> list[list[int]]:
    """Indices of `lengths` grouped so that `len(bin) * max(bin lengths) <= max_tokens`."""
    check_fits(lengths, max_tokens)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"ppo_micro_batch_size_per_gpu must be >= 1, got {max_samples}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        current = bins[-1] if bins else None
        # Longest first: the bin's first sample fixes its padded length.
        fits = current is not None and (len(current) + 1) * lengths[current[0]] <= max_tokens
        if fits and current is not None and (max_samples is None or len(current) < max_samples):
            current.append(i)
        else:
            bins.append([i])
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
