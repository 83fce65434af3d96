"""The engine profiler: this machine's step, prefill and collective times as a lenpredict
`Profile` (JSON), which the latency model is fitted from.

    python -m patrl.rollout.profile --model DIR --out profile.json [--quick]
    torchrun --nproc-per-node 2 -m patrl.rollout.profile --model DIR --out p.json --tp-sizes 1 2

A decode row: the median `engine.step()` of B sequences holding C tokens (scheduling and
sampling included). A verify row (grid `query_lens`): the same with every sequence carrying q
query tokens, its last one and q - 1 drafted ones (verification and rollback included), which
prices speculation (`rollout.speculative.latency_profile`). A prefill row: one `step()` prefilling N sequences of T tokens. Passes are
interleaved so a burst of load hits one sample of a row. Under torchrun every TP group of a
size measures at once, as a rollout's replicas run; rank 0's group's rows are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from patrl.lenpredict import (
    CollectiveRow,
    DecodeRow,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
    SwitchRow,
    VerifyRow,
)
from patrl.rollout.adaptive.reconfig import reconfigure
from patrl.rollout.config import EngineConfig
from patrl.rollout.drafter import Draft, Drafter
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.tp_policy import StaticTP
from patrl.tpreshard import (
    GroupCache,
    ParallelLayout,
    single_process_layout,
    tp_all_gather_into,
    tp_all_reduce,
    tp_broadcast,
)
from patrl.tpreshard.comm import recv, send

COLLECTIVE_OPS = ("all_reduce", "all_gather", "broadcast", "send")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """What to measure. `contexts` are tokens per sequence (the prompt length of a decode
    cell); a decode row's context is the batch's total."""

    tp_sizes: tuple[int, ...] = (1,)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (16, 64, 128, 256, 512)
    prefill_tokens: tuple[int, ...] = (8, 32, 64, 128, 256, 512)
    # sequences per prefill row, each at every prefill_tokens
    prefill_seqs: tuple[int, ...] = (1, 4)
    collective_bytes: tuple[int, ...] = (4, 4096, 65536, 1 << 20, 4 << 20)
    decode_steps: int = 8  # timed decode steps per cell and pass
    passes: int = 3
    warmup_steps: int = 8
    # "wall": seconds a rollout waits (what a profile is for). "cpu": this thread's CPU seconds,
    # which other processes' load barely moves, for comparisons that must hold on a shared,
    # oversubscribed machine (single-threaded torch on CPU only: nothing else is counted).
    # Collectives are always timed on the wall clock: their waiting is not this thread's CPU.
    clock: str = "wall"
    # RL rollouts sample; greedy rows skip the per-row draw and would price steps too low
    temperature: float = 1.0
    # a decode cell's sequences are this many samples of each of its prompts (GRPO's n), the
    # prompt's KV blocks shared as in a rollout; 1: every sequence its own prompt. Also what
    # makes a long context affordable to profile: a cell prefills ceil(batch / n) prompts.
    samples_per_prompt: int = 1
    # query tokens per sequence of verify rows (speculative decoding), each > 1, measured at
    # every decode cell; () measures none
    query_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        names = ("tp_sizes", "batch_sizes", "contexts", "prefill_tokens", "prefill_seqs")
        for name in (*names, "collective_bytes"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be non-empty positive integers, got {values}")
        for name in ("decode_steps", "passes", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if any(q < 2 for q in self.query_lens):
            raise ValueError(f"query_lens must be integers > 1, got {self.query_lens}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {self.clock!r}")

    @property
    def decode_tokens(self) -> int:
        """The most tokens a cell decodes after its prompt (a verify cell's q a step)."""
        return self.decode_steps * max((1, *self.query_lens)) + 1

    @property
    def max_model_len(self) -> int:
        return max(max(self.contexts) + self.decode_tokens, max(self.prefill_tokens) + 1)

    def fit_to(self, max_len: int) -> ProfileGrid:
        """The grid without the cells a model of `max_len` positions cannot run."""
        contexts = tuple(c for c in self.contexts if c + self.decode_tokens <= max_len)
        prefill = tuple(t for t in self.prefill_tokens if t + 1 <= max_len)
        if not contexts or not prefill:
            raise ValueError(
                f"no grid cell fits max_position_embeddings={max_len}: contexts={self.contexts} "
                f"(+{self.decode_tokens} decode tokens), prefill_tokens={self.prefill_tokens}"
            )
        return dataclasses.replace(self, contexts=contexts, prefill_tokens=prefill)

    def decode_cells(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.batch_sizes for c in self.contexts]

    def verify_cells(self) -> list[tuple[int, int, int]]:
        """(batch, context, query tokens per sequence) of every verify row."""
        return [(b, c, q) for b, c in self.decode_cells() for q in self.query_lens]

    def prefill_cells(self) -> list[tuple[int, int]]:
        """(sequences, tokens each) of every prefill row."""
        return [(n, t) for n in self.prefill_seqs for t in self.prefill_tokens]


def quick_grid(tp_sizes: Sequence[int] = (1,)) -> ProfileGrid:
    """A small grid for tests and a first look: seconds on a tiny model."""
    return ProfileGrid(
        tp_sizes=tuple(tp_sizes),
        batch_sizes=(1, 2, 4, 8),
        contexts=(16, 48, 96),
        prefill_tokens=(8, 32, 64, 128),
        collective_bytes=(4, 16384, 262144),
        decode_steps=6,
        passes=3,
        warmup_steps=4,
    )


# --------------------------------------------------------------------- identity


def model_info(model_dir: str | Path, engine: Engine) -> ModelInfo:
    """The architecture facts of the engine's model; the parameter count is read from the
    checkpoint (so it is the same at every TP size, whatever each rank holds)."""
    mc = engine.model.config
    return ModelInfo(
        name=Path(model_dir).name,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_attention_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        num_params=checkpoint_num_params(model_dir),
    )


def checkpoint_num_params(model_dir: str | Path) -> int:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def engine_dtype(engine: Engine) -> str:
    return str(next(engine.model.parameters()).dtype).removeprefix("torch.")


def hardware_info(device: torch.device, num_devices: int, backend: str) -> HardwareInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, props.total_memory
    else:
        name = _cpu_name()
        # one machine's memory shared by every rank
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_devices
    return HardwareInfo(
        name=platform.node() or "unknown host",
        device=f"{device.type}: {name}, {torch.get_num_threads()} thread(s) per rank",
        num_devices=num_devices,
        memory_bytes_per_device=memory,
        interconnect=backend if num_devices > 1 else "none",
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------- engine rows


def profile_engine_config(base: EngineConfig, grid: ProfileGrid) -> EngineConfig:
    """The engine as the user runs it (model, dtype, device, attention backend, block size,
    prefix caching all change step times), with budgets that admit every grid cell in one
    prefill and never preempt."""
    longest = max(grid.contexts) + grid.decode_tokens
    batch = max(grid.batch_sizes)
    block = base.block_size
    prefill_blocks = max(n * -(-(t + 1) // block) for n, t in grid.prefill_cells())
    blocks = max(batch * -(-longest // block), prefill_blocks) + -(-grid.max_model_len // block) + 1
    prefill_tokens = max(n * t for n, t in grid.prefill_cells())
    return base.model_copy(
        update={
            "num_kv_blocks": blocks,
            "max_num_seqs": max(batch, *grid.prefill_seqs),
            "max_num_batched_tokens": max(batch * max(grid.contexts), prefill_tokens),
            "max_model_len": grid.max_model_len,
            "tp_policy": StaticTP(),  # each cell is measured at one fixed layout
        }
    )


@dataclass(slots=True)
class _Samples:
    decode: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    prefill: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    verify: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)


class FixedDrafts(Drafter):
    """Drafts `length` tokens (token 0, mostly rejected) for every sequence at every step and
    always verifies them: the verify rows' drafter, whose steps carry a known query length."""

    def __init__(self, length: int) -> None:
        super().__init__(length, adaptive=False)

    def propose(self, seq_id: int, context: Sequence[int], limit: int) -> Draft:
        return Draft([0] * min(limit, self.max_draft), "group")


def _prompts(engine: Engine, count: int, tokens: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    return [torch.randint(0, vocab, (tokens,), generator=g).tolist() for _ in range(count)]


def timed_steps(
    engine: Engine, clock: Callable[[], float] = time.perf_counter
) -> list[tuple[float, bool, int]]:
    """Run the engine dry; (seconds of each step() call, was it a prefill, tokens run)."""
    out = []
    while engine.has_unfinished():
        before = len(engine.timeline)
        start = clock()
        engine.step()
        seconds = clock() - start
        if len(engine.timeline) > before:
            rec = engine.timeline[-1]
            out.append((seconds, rec.is_prefill, rec.num_tokens))
    return out


def measure_decode(
    engine: Engine,
    batch: int,
    context: int,
    steps: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    temperature: float = 1.0,
    samples_per_prompt: int = 1,
) -> float:
    """Median seconds of a decode step of `batch` sequences of `context` prompt tokens,
    `samples_per_prompt` samples of each prompt (the last prompt may have fewer)."""
    prompts = _prompts(engine, -(-batch // samples_per_prompt), context, seed)
    for i, prompt in enumerate(prompts):
        n = min(samples_per_prompt, batch - i * samples_per_prompt)
        params = SamplingParams(
            temperature=temperature, seed=seed + i, ignore_eos=True, max_tokens=steps + 1, n=n
        )
        engine.add_request(prompt, params)
    decode = [s for s, is_prefill, n in timed_steps(engine, clock) if not is_prefill and n == batch]
    if len(decode) != steps:
        raise RuntimeError(
            f"expected {steps} decode steps of batch {batch}, got {len(decode)}: the profiling "
            "engine's budgets did not admit the cell in one prefill"
        )
    return statistics.median(decode)


def measure_verify(
    engine: Engine,
    batch: int,
    context: int,
    query_len: int,
    steps: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    temperature: float = 1.0,
    samples_per_prompt: int = 1,
) -> float:
    """Median seconds of a verify step of `batch` sequences of `context` prompt tokens, each
    carrying `query_len` query tokens (`FixedDrafts`), over up to `steps` such steps. The
    engine's own drafter is put back after."""
    own = engine.drafter
    engine.drafter = engine.scheduler.drafter = FixedDrafts(query_len - 1)
    try:
        prompts = _prompts(engine, -(-batch // samples_per_prompt), context, seed)
        for i, prompt in enumerate(prompts):
            n = min(samples_per_prompt, batch - i * samples_per_prompt)
            params = SamplingParams(
                temperature=temperature,
                seed=seed + i,
                ignore_eos=True,
                max_tokens=steps * query_len + 1,
                n=n,
            )
            engine.add_request(prompt, params)
        full = batch * query_len
        verify = [
            s for s, is_prefill, n in timed_steps(engine, clock) if not is_prefill and n == full
        ]
    finally:
        engine.drafter = engine.scheduler.drafter = own
    if not verify:
        raise RuntimeError(f"no verify step of {batch} sequences x {query_len} query tokens ran")
    return statistics.median(verify[:steps])


def measure_prefill(
    engine: Engine,
    tokens: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    temperature: float = 1.0,
    num_seqs: int = 1,
) -> float:
    """Seconds of the one step that prefills `num_seqs` distinct prompts of `tokens` tokens."""
    params = SamplingParams(temperature=temperature, seed=seed, ignore_eos=True, max_tokens=1)
    for prompt in _prompts(engine, num_seqs, tokens, seed):
        engine.add_request(prompt, params)
    prefill = [s for s, is_prefill, _ in timed_steps(engine, clock) if is_prefill]
    if len(prefill) != 1:
        raise RuntimeError(
            f"{num_seqs} prompts of {tokens} tokens took {len(prefill)} prefill steps, not 1"
        )
    return prefill[0]


def decode_context_tokens(batch: int, context: int, steps: int) -> int:
    """Total context of the middle timed step: after the prefill each sequence holds its
    prompt and first token, and grows by one per step (the simulator's accounting)."""
    return round(batch * (context + 1 + (steps - 1) / 2))


def measure_engine(
    engine: Engine, grid: ProfileGrid, tick: Callable[[], None] = lambda: None
) -> tuple[list[DecodeRow], list[PrefillRow], list[VerifyRow]]:
    """Decode, prefill and verify rows of one engine (every rank of its TP group calls
    this)."""
    tp, clock = engine.layout.tp_size, CLOCKS[grid.clock]
    n = grid.samples_per_prompt
    measure_decode(
        engine, max(grid.batch_sizes), max(grid.contexts), grid.warmup_steps, 1 << 30, clock,
        grid.temperature, n,
    )  # fmt: skip
    samples = _Samples()
    seed = 0
    for _ in range(grid.passes):
        for batch, context in grid.decode_cells():
            seconds = measure_decode(
                engine, batch, context, grid.decode_steps, seed, clock, grid.temperature, n
            )
            samples.decode.setdefault((batch, context), []).append(seconds)
            seed += 1
            tick()
        for num_seqs, tokens in grid.prefill_cells():
            samples.prefill.setdefault((num_seqs, tokens), []).append(
                measure_prefill(engine, tokens, seed, clock, grid.temperature, num_seqs)
            )
            seed += 1
            tick()
        for batch, context, q in grid.verify_cells():
            seconds = measure_verify(
                engine, batch, context, q, grid.decode_steps, seed, clock, grid.temperature, n
            )
            samples.verify.setdefault((batch, context, q), []).append(seconds)
            seed += 1
            tick()
    decode = [
        DecodeRow(
            tp=tp,
            batch=b,
            context_tokens=decode_context_tokens(b, c, grid.decode_steps),
            seconds=statistics.median(t),
        )
        for (b, c), t in samples.decode.items()
    ]
    prefill = [
        PrefillRow(tp=tp, tokens=t, num_seqs=n, seconds=statistics.median(s))
        for (n, t), s in samples.prefill.items()
    ]
    verify = [
        VerifyRow(
            tp=tp,
            batch=b,
            query_len=q,
            context_tokens=decode_context_tokens(b, c, grid.decode_steps),
            seconds=statistics.median(t),
        )
        for (b, c, q), t in samples.verify.items()
    ]
    return decode, prefill, verify


# --------------------------------------------------------------------- collectives


def measure_collective(
    op: str,
    nbytes: int,
    layout: ParallelLayout,
    repeats: int,
    iters: int = 5,
    *,
    device: torch.device,
) -> tuple[float, int]:
    """Median seconds of one `op` whose result is about `nbytes` per rank, on the layout's TP
    group, and the exact bytes of that result (every rank of the group calls this; rank 0's
    clock is the one reported). The tensors live on `device`, the engine's (NCCL takes no
    host tensors); on CUDA the device is synchronised around the timed region, so the clock
    sees the collectives finish and not just their launches."""
    group, size, rank = layout.tp_group, layout.tp_size, layout.tp_rank
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"unknown collective op {op!r}; choose one of {COLLECTIVE_OPS}")
    if op == "send" and size != 2:
        raise ValueError(f"send is measured between the 2 ranks of a TP group, not {size}")
    numel = max(1, nbytes // 4)
    result = torch.zeros(numel, device=device)
    shard = torch.zeros(max(1, numel // size), device=device)
    gathered = torch.zeros(shard.numel() * size, device=device)

    def once() -> None:
        # the TP ops go the way the engine's layers send them (tp_comm when the layout has
        # one); point-to-point (KV moves) stays on the process group
        if op == "all_reduce":
            tp_all_reduce(layout, result)
        elif op == "all_gather":
            tp_all_gather_into(layout, gathered.view(size, -1), shard)
        elif op == "broadcast":
            tp_broadcast(layout, result, src=0)
        elif rank == 0:
            send(group, result, dst=1)
        else:
            recv(group, result, src=0)

    once()  # warm-up: first use of a size allocates buffers
    samples = []
    for _ in range(repeats):
        _synchronize(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            once()
        _synchronize(device)
        if op == "send":  # a send returns when the data left; time until it arrived
            dist.barrier(group=group)
        samples.append((time.perf_counter() - start) / iters)
    held = gathered if op == "all_gather" else result
    return statistics.median(samples), held.numel() * held.element_size()


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA, where ops run synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_collectives(
    layout: ParallelLayout,
    grid: ProfileGrid,
    tick: Callable[[], None] = lambda: None,
    *,
    device: torch.device,
) -> list[CollectiveRow]:
    rows = []
    for op in COLLECTIVE_OPS:
        if op == "send" and layout.tp_size != 2:
            continue  # point-to-point is priced per link: one pair is enough
        for nbytes in grid.collective_bytes:
            seconds, held = measure_collective(op, nbytes, layout, grid.passes, device=device)
            rows.append(
                CollectiveRow(
                    op=op,
                    nbytes=held,
                    group_size=layout.tp_size,
                    seconds=seconds,
                )
            )
            tick()
    return rows


# --------------------------------------------------------------------- whole profiles


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="profile", unit="cell")


def _num_ticks(grid: ProfileGrid, tp_sizes: Sequence[int]) -> int:
    cells = len(grid.decode_cells()) + len(grid.prefill_cells()) + len(grid.verify_cells())
    per_tp = grid.passes * cells
    ops = [len(COLLECTIVE_OPS) - (tp != 2) for tp in tp_sizes if tp > 1]
    return per_tp * len(tp_sizes) + sum(ops) * len(grid.collective_bytes)


def profile_single(base: EngineConfig, grid: ProfileGrid, progress: bool = False) -> Profile:
    """Profile the engine configured by `base` at TP=1 in this process (no process group)."""
    if grid.tp_sizes != (1,):
        raise ValueError(
            f"tp_sizes={grid.tp_sizes} need one process per rank: run under torchrun "
            "(profile_distributed); a single process profiles tp_sizes=(1,)"
        )
    engine = Engine(profile_engine_config(base, grid), single_process_layout())
    bar = _progress(_num_ticks(grid, (1,)), progress)
    decode, prefill, verify = measure_engine(engine, grid, _ticker(bar))
    if bar is not None:
        bar.close()
    return _profile(base.model, engine, 1, "none", decode, prefill, [], grid, verify=verify)


def profile_distributed(
    base: EngineConfig,
    grid: ProfileGrid,
    world: Any,
    progress: bool = False,
    wait_timeout_s: float = 3600.0,
) -> Profile | None:
    """Profile the engine configured by `base` at every TP size of the grid on the ranks of
    the process group `world`; returns the profile on rank 0 of `world`, None elsewhere.
    Every rank of `world` must call this."""
    world_size, rank = dist.get_world_size(world), dist.get_rank(world)
    if dist.get_world_size() != world_size:
        raise ValueError("profile_distributed needs `world` to span the whole job")
    cache = GroupCache(grid.tp_sizes, world_size=world_size, rank=rank, tp_comm=base.tp_comm)
    # waiting ranks sit in a barrier while another group measures: give it a long timeout
    wait = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=wait_timeout_s))
    bar = _progress(_num_ticks(grid, grid.tp_sizes), progress and rank == 0)
    tick = _ticker(bar)
    decode: list[DecodeRow] = []
    prefill: list[PrefillRow] = []
    verify: list[VerifyRow] = []
    collectives: list[CollectiveRow] = []
    identity: Engine | None = None
    for tp in grid.tp_sizes:
        # Every TP group of this size measures at once, as a rollout runs its replicas: they
        # share the host's cores, memory bandwidth and links. The rows of rank 0's group are
        # kept.
        layout = cache.layout(tp)
        engine = Engine(profile_engine_config(base, grid), layout)
        rows = measure_engine(engine, grid, tick)
        group_collectives = (
            measure_collectives(layout, grid, tick, device=engine.device) if tp > 1 else []
        )
        if rank < tp:
            decode += rows[0]
            prefill += rows[1]
            verify += rows[2]
            collectives += group_collectives
            identity = identity or engine
        del engine
        dist.barrier(group=wait)
    switches = measure_switches(base, grid, cache, world)
    if bar is not None:
        bar.close()
    if rank != 0:
        return None
    assert identity is not None  # rank 0 is in a group of every size
    backend = str(dist.get_backend(world))
    return _profile(
        base.model, identity, world_size, backend, decode, prefill, collectives, grid, switches,
        verify,
    )  # fmt: skip


def measure_switches(
    base: EngineConfig, grid: ProfileGrid, cache: GroupCache, world: Any, repeats: int = 2
) -> list[SwitchRow]:
    """Seconds of `reconfigure` between every two TP sizes of the grid, the slowest rank's,
    after one untimed round trip (a process's first switch pays one-time costs): empty (the
    fixed price of a switch), then with sequences in flight at the grid's shortest and
    longest contexts, so the latency model can tell a price per sequence from one per
    context token. Every rank of `world` calls it at once."""
    tps = sorted(grid.tp_sizes)
    if len(tps) < 2:
        return []
    engine = Engine(profile_engine_config(base, grid), cache.layout(tps[0]), groups=cache)
    for tp in [*tps[1:], tps[0]]:
        reconfigure(engine, tp)
    world_size = dist.get_world_size(world)
    largest, short, long = max(grid.batch_sizes), min(grid.contexts), max(grid.contexts)
    quarter = max(1, largest // 4)
    loads = sorted({(0, 0), (quarter, short), (largest, short), (quarter, long)})
    rows: list[SwitchRow] = []
    for src, dst in itertools.permutations(tps, 2):
        for load, prompt in [load for load in loads for _ in range(repeats)]:
            if engine.layout.tp_size != src:
                reconfigure(engine, src)
            num_seqs = context = 0
            if load:
                num_seqs, context = _fill(engine, load, prompt, world_size, seed=len(rows))
            dist.barrier(group=world)
            start = time.perf_counter()
            reconfigure(engine, dst)
            dist.barrier(group=world)
            seconds = time.perf_counter() - start
            rows.append(
                SwitchRow(
                    src_tp=src,
                    dst_tp=dst,
                    seconds=seconds,
                    num_seqs=num_seqs,
                    context_tokens=context,
                )
            )
            while engine.has_unfinished():
                engine.step()
    return rows


def _fill(
    engine: Engine, total: int, prompt_tokens: int, world_size: int, seed: int
) -> tuple[int, int]:
    """Put `total` sequences of `prompt_tokens`-token prompts in flight across the world,
    split over this layout's replicas, each past its prefill and one decode step with one
    token to go; returns (sequences, context tokens) across the world."""
    replicas = world_size // engine.layout.tp_size
    per_replica = max(1, total // replicas)
    params = SamplingParams(seed=seed, ignore_eos=True, max_tokens=3)
    for prompt in _prompts(engine, per_replica, prompt_tokens, seed):
        engine.add_request(prompt, params)
    while any(len(s.output_token_ids) < 2 for s in engine.unfinished_seqs()):
        engine.step()
    # as measured: a sequence that hit max_model_len already has left
    left = engine.unfinished_seqs()
    held = sum(s.num_tokens - 1 for s in left)  # the newest token has no KV yet
    return len(left) * replicas, held * replicas


def _ticker(bar: Any) -> Callable[[], None]:
    return (lambda: bar.update(1)) if bar is not None else (lambda: None)


def _profile(
    model_dir: str,
    engine: Engine,
    num_devices: int,
    backend: str,
    decode: list[DecodeRow],
    prefill: list[PrefillRow],
    collectives: list[CollectiveRow],
    grid: ProfileGrid,
    switches: list[SwitchRow] | None = None,
    verify: list[VerifyRow] | None = None,
) -> Profile:
    return Profile(
        source="measured",
        hardware=hardware_info(engine.device, num_devices, backend),
        model=model_info(model_dir, engine),
        dtype=engine_dtype(engine),
        decode=decode,
        prefill=prefill,
        collectives=collectives,
        switches=switches or [],
        verify=verify or [],
        notes={
            "profiler": "patrl.rollout.profile",
            "grid": repr(grid),
            "decode_seconds": "median engine.step() call (schedule + forward + sample) "
            "over the timed steps of a cell, then median over passes",
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        },
    )


def write_atomic(profile: Profile, path: str | Path) -> None:
    """Write next to the target, then rename: a reader never sees half a profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(profile.model_dump_json(indent=1))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m patrl.rollout.profile",
        description="Measure the engine's step / prefill / collective times into a "
        "lenpredict Profile JSON. Run under torchrun for TP sizes > 1.",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--out", required=True, help="profile JSON to write (atomically)")
    p.add_argument("--tp-sizes", type=int, nargs="+", help="default: 1 and the world size")
    p.add_argument("--batch-sizes", type=int, nargs="+")
    p.add_argument("--context", type=int, nargs="+", help="tokens per sequence of decode cells")
    p.add_argument("--prefill-tokens", type=int, nargs="+")
    p.add_argument(
        "--prefill-seqs", type=int, nargs="+", help="sequences per prefill row (default 1 4)"
    )
    p.add_argument("--passes", type=int, help="interleaved passes over the grid (medians)")
    p.add_argument(
        "--query-lens", type=int, nargs="+", help="verify rows: query tokens per sequence (> 1)"
    )
    p.add_argument("--quick", action="store_true", help="a small grid (seconds on a tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--block-size", type=int, default=None, help="default: the backend's")
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="profile an engine that runs without it"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="see ProfileGrid")
    return p.parse_args(argv)


def grid_from_args(args: argparse.Namespace, world_size: int) -> ProfileGrid:
    tp_sizes = tuple(args.tp_sizes or sorted({1, world_size}))
    base = quick_grid(tp_sizes) if args.quick else ProfileGrid(tp_sizes=tp_sizes)
    overrides: dict[str, Any] = {
        "batch_sizes": args.batch_sizes,
        "contexts": args.context,
        "prefill_tokens": args.prefill_tokens,
        "prefill_seqs": args.prefill_seqs,
        "passes": args.passes,
        "query_lens": args.query_lens,
        "clock": args.clock,
    }
    kept = {k: v for k, v in overrides.items() if v is not None}
    kept = {k: tuple(v) if isinstance(v, list) else v for k, v in kept.items()}
    return dataclasses.replace(base, **kept)


def max_positions(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # ranks share the machine's cores
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    start = time.perf_counter()
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if distributed:
        device = base.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # CUDA tensors over NCCL, objects (and CPU tensors) over gloo
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        try:
            grid = grid_from_args(args, dist.get_world_size()).fit_to(max_positions(args.model))
            world = dist.group.WORLD
            profile = profile_distributed(base, grid, world, progress=True)
        finally:
            dist.destroy_process_group()
    else:
        grid = grid_from_args(args, 1).fit_to(max_positions(args.model))
        profile = profile_single(base, grid, progress=True)
    if profile is None:
        return
    write_atomic(profile, args.out)
    print(
        f"wrote {args.out}: {len(profile.decode)} decode, {len(profile.prefill)} prefill, "
        f"{len(profile.collectives)} collective rows in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
