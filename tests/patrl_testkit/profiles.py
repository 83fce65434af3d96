"""Latency profiles with a known answer for tests that drive the adaptive-TP planner.

Synthetic, nothing measured: the planner's decisions on them are known in advance.
"""

from __future__ import annotations

from patrl.lenpredict import (
    CollectiveRow,
    DecodeRow,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
)


def synthetic_profile(model_dir: str, tp2_speedup: float, crossover: int = 0) -> Profile:
    """Step time = (1 ms + 0.1 ms x batch) / speedup at tp=2; switches cost ~1 ms of sends.
    With a `crossover` batch, tp=2 instead costs 0.05 x crossover ms more a step and 0.05 ms
    less per sequence: faster than tp=1 at the same batch only past `crossover` sequences."""
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

    def step(tp: int, batch: int) -> float:
        if crossover and tp == 2:
            return 1e-3 + 1e-4 * batch + 5e-5 * (crossover - batch)
        return (1e-3 + 1e-4 * batch) / (tp2_speedup if tp == 2 else 1.0)

    return Profile(
        source="measured",
        hardware=HardwareInfo(
            name="synthetic",
            device="cpu",
            num_devices=2,
            memory_bytes_per_device=1 << 34,
            interconnect="synthetic",
        ),
        model=info,
        dtype="float32",
        decode=[
            DecodeRow(tp=tp, batch=b, context_tokens=b * c, seconds=step(tp, b))
            for tp in (1, 2)
            for b in (1, 2, 4, 8, 16, 32, 64)
            for c in (8, 32, 96)
        ],
        prefill=[
            PrefillRow(tp=tp, tokens=t, seconds=1e-3 + 1e-5 * t)
            for tp in (1, 2)
            for t in (8, 64, 512)
        ],
        collectives=[
            CollectiveRow(op=op, nbytes=n, group_size=2, seconds=1e-4 + 1e-9 * n)
            for op in ("all_reduce", "all_gather", "broadcast", "send")
            for n in (1024, 1 << 16, 1 << 22)
        ],
    )
