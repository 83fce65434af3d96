"""Profiles with known shapes for lenpredict's tests (synthetic: nothing here is measured)."""

from __future__ import annotations

from collections.abc import Callable

from patrl.lenpredict import (
    CollectiveRow,
    DecodeRow,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
)

TINY = ModelInfo(
    name="tiny-llama",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    num_params=120_000,
)

StepFn = Callable[[int, int, int], float]
# (tp, batch, total context, longest context) -> seconds
PaddedStepFn = Callable[[int, int, int, int], float]


def profile_from(
    step: StepFn,
    *,
    padded: PaddedStepFn | None = None,
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8),
    prefill_per_token_s: float = 1e-4,
    prefill_quadratic_s: float = 0.0,
    prefill_per_seq_s: float | None = None,
    send_per_byte_s: float = 1e-9,
    alpha_s: float = 1e-4,
    num_devices: int = 8,
    memory_bytes: int = 10**12,
    dtype: str = "float32",
) -> Profile:
    """A profile whose decode rows follow `step(tp, batch, context)` exactly; with `padded`,
    rows of equal lengths and skewed rows (one sequence 8x the others) follow
    `padded(tp, batch, context, longest)` instead. With `prefill_per_seq_s`, prefill rows of 1,
    4 and 16 sequences, each sequence adding that much beyond its tokens; without, rows of
    one sequence."""
    cells = [
        (tp, b, c)
        for tp in tp_sizes
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        for c in (64, 512, 2048, 8192)
    ]
    if padded is None:
        decode = [
            DecodeRow(tp=tp, batch=b, context_tokens=b * c, seconds=step(tp, b, b * c))
            for tp, b, c in cells
        ]
    else:
        decode = [
            DecodeRow(
                tp=tp, batch=b, context_tokens=total, max_context=m, seconds=padded(tp, b, total, m)
            )
            for tp, b, c in cells
            for total, m in {(b * c, c), ((b - 1) * c + 8 * c, 8 * c)}
        ]
    prefill = [
        PrefillRow(
            tp=tp,
            tokens=t,
            num_seqs=k,
            seconds=alpha_s
            + k
            * ((prefill_per_seq_s or 0.0) + prefill_per_token_s * t + prefill_quadratic_s * t * t)
            / tp,
        )
        for tp in tp_sizes
        for t in (16, 128, 1024, 8192)
        for k in ((1,) if prefill_per_seq_s is None else (1, 4, 16))
    ]
    collectives = [
        CollectiveRow(op=op, nbytes=n, group_size=g, seconds=alpha_s + send_per_byte_s * n)
        for op in ("all_reduce", "all_gather", "broadcast", "send")
        for g in (2, 4, 8)
        for n in (4096, 1 << 20, 1 << 26)
    ]
    return Profile(
        source="measured",
        hardware=HardwareInfo(
            name="synthetic",
            device="synthetic",
            num_devices=num_devices,
            memory_bytes_per_device=memory_bytes,
            interconnect="synthetic",
        ),
        model=TINY,
        dtype=dtype,  # type: ignore[arg-type]
        decode=decode,
        prefill=prefill,
        collectives=collectives,
    )


def flat(tp: int, batch: int, context: int) -> float:
    """Every step costs the same, whatever the layout: TP can never help."""
    return 0.01


def tp_speeds_up(tp: int, batch: int, context: int) -> float:
    """Memory-bound GPU-like: weights split over TP ranks, a small per-step collective cost."""
    return 0.008 / tp + 0.0002 * (tp > 1) + 2e-5 * batch / tp + 1e-8 * context / tp


def gloo_like(tp: int, batch: int, context: int) -> float:
    """Shaped like this CPU box (research/feasibility.md §4, bf16): TP=2 over gloo costs more
    per step than TP=1 at every batch size (B=1: ~29 ms vs ~60 ms; B=32: ~88 ms vs ~100 ms)."""
    return 0.029 + 0.0019 * batch + 1e-7 * context + (0.031 if tp > 1 else 0.0) * tp / 2


def compute_bound(tp: int, batch: int, context: int) -> float:
    """Compute-bound with a per-token collective: at large batches DP beats TP."""
    return 0.001 / tp + 0.002 * batch / tp + (0.0003 + 1e-4 * batch) * (tp > 1)


def cpu_knee(tp: int, batch: int, context: int) -> float:
    """This CPU box's shape since TP goes through shared memory (wide_2l): small batches are
    dear (single-threaded sgemm), the slope drops past 4 sequences, TP faster everywhere."""
    per_rank = 0.011 * min(batch, 4) + 0.0035 * max(0, batch - 4)
    return 0.017 / tp + per_rank / tp + 0.001 * (tp > 1) + 1e-8 * context / tp


def cpu_two_knees(tp: int, batch: int, context: int) -> float:
    """This CPU box's vocab_2l profile (2026-11-24): batch 4 costs ~2.6x batch 1, batch 16
    little more than batch 4, and the slope rises again past 16 (two knees, two ways)."""
    per_rank = 0.0147 * min(batch, 4) + 0.0037 * min(max(0, batch - 4), 12)
    per_rank += 0.0069 * max(0, batch - 16)
    return 0.012 / tp + per_rank / tp + 0.001 * (tp > 1) + 1e-8 * context / tp


def sdpa_like(tp: int, batch: int, context: int, longest: int) -> float:
    """A padded attention backend (this machine's sdpa): every sequence reads the longest
    one's blocks; a compute knee at 32 sequences. `tp_speeds_up` otherwise."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * batch * longest / tp + 1e-4 * max(0, batch - 32) / tp


def padded_no_knee(tp: int, batch: int, context: int, longest: int) -> float:
    """`sdpa_like` without its compute knee: a padded term on a fit with no knee to sum."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * batch * longest / tp


def ragged_like(tp: int, batch: int, context: int, longest: int) -> float:
    """A ragged attention backend (flash): only the total context costs."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * context / tp
