"""How many bytes the KV cache gets: a fixed budget, or vLLM's `gpu_memory_utilization` rule.

With neither `num_kv_blocks` nor `kv_cache_memory_bytes` set, a CUDA engine's KV cache gets
`gpu_memory_utilization` x the device's total memory, less what is in use once the weights
are loaded and the communicators made, less the peak activation memory of a profiling forward
(`ModelRunner` runs it). A CPU engine, with no device memory to measure, gets what its
budgets can ever use, at most `CPU_KV_BYTES` (`cpu_kv_bytes`): a tiny model does not pay
for a large cache it never fills. Device reads go through a `MemoryProbe` (`probe_for`),
which tests replace to check the arithmetic on CPU. See docs/architecture.md ("Memory").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

CPU_KV_BYTES = 512 << 20  # the most KV an engine without a device to measure takes


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """`torch.cuda.mem_get_info` of one device: bytes free and in all."""

    free: int
    total: int


class MemoryProbe(Protocol):
    """What the KV sizing reads from a device."""

    def read(self) -> DeviceMemory:
        """Free and total bytes now, memory the allocator caches but holds no tensor in
        handed back first."""
        ...

    def peak_during(self, fn: Callable[[], object]) -> int:
        """Run `fn`; the most bytes it held allocated at once beyond what was allocated
        before it."""
        ...


class CudaProbe:
    """A `MemoryProbe` of one CUDA device, from torch.cuda's allocator statistics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(free, total)

    def peak_during(self, fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)


def cpu_kv_bytes(
    bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int
) -> int:
    """The KV budget of an engine without a device to measure: blocks for `max_num_seqs`
    sequences of `max_model_len` tokens each (the most the scheduler ever holds: it then never
    preempts), at most `CPU_KV_BYTES`. `bytes_per_block` is taken at the smallest TP size
    the engine may run, where a block holds the most heads: the budget is kept across
    layouts, and a larger TP size fits at least as many tokens in it."""
    blocks_per_seq = -(-max_model_len // block_size)
    return min(CPU_KV_BYTES, max_num_seqs * blocks_per_seq * bytes_per_block)


def probe_for(device: torch.device) -> MemoryProbe | None:
    """The probe of `device`, or None where the KV budget is not measured (CPU)."""
    return CudaProbe(device) if device.type == "cuda" else None


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The numbers a memory-sized KV cache came from (bytes): the device's `total`, the
    bytes `in_use` after loading (every process's: weights, communicators, the context), of
    which `weights` are this engine's, and the profiled `activation` peak of a forward of
    `profiled_tokens` tokens."""

    utilization: float
    total: int
    in_use: int
    weights: int
    activation: int
    profiled_tokens: int

    @property
    def kv_bytes(self) -> int:
        """utilization x total - in_use - activation, at least 0."""
        return max(0, int(self.utilization * self.total) - self.in_use - self.activation)

    def describe(self) -> str:
        return (
            f"gpu_memory_utilization={self.utilization} x {_gib(self.total)} total = "
            f"{_gib(int(self.utilization * self.total))}; in use after loading: "
            f"{_gib(self.in_use)} (this engine's weights: {_gib(self.weights)}; free: "
            f"{_gib(self.total - self.in_use)}); activations of a {self.profiled_tokens}-token "
            f"forward: {_gib(self.activation)}; left for KV: {_gib(self.kv_bytes)}"
        )


def measure_budget(
    probe: MemoryProbe,
    utilization: float,
    weights: int,
    tokens: int,
    profile: Callable[[], object],
) -> KVBudget:
    """Run `profile` (a forward of `tokens` tokens) under `probe`, then read the device: the
    KV budget of an engine whose weights (`weights` bytes) are loaded."""
    activation = probe.peak_during(profile)
    memory = probe.read()
    return KVBudget(
        utilization, memory.total, memory.total - memory.free, weights, activation, tokens
    )


def check_fits(
    num_blocks: int, block_size: int, max_model_len: int, budget: KVBudget | None
) -> None:
    """Raise unless `num_blocks` blocks hold one `max_model_len` sequence; the message names
    the numbers the blocks came from and what to change."""
    tokens = num_blocks * block_size
    if tokens >= max_model_len:
        return
    head = (
        f"the KV cache ({num_blocks} blocks x block_size={block_size} = {tokens} tokens) "
        f"cannot hold one max_model_len={max_model_len} sequence"
    )
    if budget is None:
        raise ValueError(
            f"{head}: raise num_kv_blocks or kv_cache_memory_bytes, or lower max_model_len"
        )
    raise ValueError(
        f"{head}. It was sized from device memory: {budget.describe()}. Raise "
        "gpu_memory_utilization, free device memory other processes hold, lower "
        "max_model_len or max_num_batched_tokens (the profiled forward), or set "
        "kv_cache_memory_bytes or num_kv_blocks"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
