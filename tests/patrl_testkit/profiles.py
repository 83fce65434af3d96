"""Synthetic latency profiles: nothing measured, so every fit, simulation and planner decision
on them is known in advance.

`profile_from(step, ...)` is the general builder (decode rows follow a step-time function
exactly); `synthetic_profile` is the adaptive-TP known-answer profile at TP 1 and 2. Both are
made of the row builders below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from patrl.lenpredict import (
    CollectiveRow,
    DecodeRow,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
)

# (tp, batch, total context) -> seconds
StepFn = Callable[[int, int, int], float]
# (tp, batch, total context, longest context) -> seconds
PaddedStepFn = Callable[[int, int, int, int], float]

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
COLLECTIVE_OPS = ("all_reduce", "all_gather", "broadcast", "send")


def synthetic_hardware(
    num_devices: int, memory_bytes: int, device: str = "synthetic"
) -> HardwareInfo:
    return HardwareInfo(
        name="synthetic",
        device=device,
        num_devices=num_devices,
        memory_bytes_per_device=memory_bytes,
        interconnect="synthetic",
    )


def decode_rows(
    step: StepFn,
    tp_sizes: Sequence[int],
    batches: Sequence[int],
    contexts: Sequence[int],
    padded: PaddedStepFn | None = None,
) -> list[DecodeRow]:
    """A row per (tp, batch, context per sequence) following `step` exactly; with `padded`,
    two rows a cell instead (equal lengths, and one sequence 8x the others) following it."""
    cells = [(tp, b, c) for tp in tp_sizes for b in batches for c in contexts]
    if padded is None:
        return [
            DecodeRow(tp=tp, batch=b, context_tokens=b * c, seconds=step(tp, b, b * c))
            for tp, b, c in cells
        ]
    return [
        DecodeRow(
            tp=tp, batch=b, context_tokens=total, max_context=m, seconds=padded(tp, b, total, m)
        )
        for tp, b, c in cells
        for total, m in {(b * c, c), ((b - 1) * c + 8 * c, 8 * c)}
    ]


def collective_rows(
    group_sizes: Sequence[int], message_bytes: Sequence[int], alpha_s: float, per_byte_s: float
) -> list[CollectiveRow]:
    """Every collective op, group size and message size at alpha_s + per_byte_s x bytes."""
    return [
        CollectiveRow(op=op, nbytes=n, group_size=g, seconds=alpha_s + per_byte_s * n)
        for op in COLLECTIVE_OPS
        for g in group_sizes
        for n in message_bytes
    ]


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
    """A profile of TINY whose decode rows follow `step(tp, batch, context)` exactly; with
    `padded`, rows of equal lengths and skewed rows (one sequence 8x the others) follow
    `padded(tp, batch, context, longest)` instead. With `prefill_per_seq_s`, prefill rows of 1,
    4 and 16 sequences, each sequence adding that much beyond its tokens; without, rows of
    one sequence."""
    decode = decode_rows(
        step, tp_sizes, (1, 2, 4, 8, 16, 32, 64, 128, 256), (64, 512, 2048, 8192), padded
    )
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
    return Profile(
        source="measured",
        hardware=synthetic_hardware(num_devices, memory_bytes),
        model=TINY,
        dtype=dtype,  # type: ignore[arg-type]
        decode=decode,
        prefill=prefill,
        collectives=collective_rows((2, 4, 8), (4096, 1 << 20, 1 << 26), alpha_s, send_per_byte_s),
    )


def synthetic_profile(
    model_dir: str, tp2_speedup: float, crossover: int = 0, tp_sizes: tuple[int, ...] = (1, 2)
) -> Profile:
    """Step time = (1 ms + 0.1 ms x batch) / speedup at tp=2 (speedup squared at tp=4, ...);
    switches cost ~1 ms of sends. With a `crossover` batch, tp=2 instead costs 0.05 x crossover
    ms more a step and 0.05 ms less per sequence: faster than tp=1 at the same batch only past
    `crossover` sequences. Rows for each of `tp_sizes` (powers of two)."""
    info = ModelInfo(
        name=model_dir,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=250,
        num_params=100_000,
    )

    def step(tp: int, batch: int, context: int) -> float:
        if crossover and tp == 2:
            return 1e-3 + 1e-4 * batch + 5e-5 * (crossover - batch)
        return (1e-3 + 1e-4 * batch) / tp2_speedup ** (tp.bit_length() - 1)

    return Profile(
        source="measured",
        hardware=synthetic_hardware(max(tp_sizes), 1 << 34, device="cpu"),
        model=info,
        dtype="float32",
        decode=decode_rows(step, tp_sizes, (1, 2, 4, 8, 16, 32, 64), (8, 32, 96)),
        prefill=[
            PrefillRow(tp=tp, tokens=t, seconds=1e-3 + 1e-5 * t)
            for tp in tp_sizes
            for t in (8, 64, 512)
        ],
        collectives=collective_rows(
            tuple(t for t in tp_sizes if t > 1), (1024, 1 << 16, 1 << 22), 1e-4, 1e-9
        ),
    )
