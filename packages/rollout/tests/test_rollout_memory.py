"""The engine's memory: the KV cache sized from device memory (gpu_memory_utilization), and
sleep / wake_up (the KV cache freed, the weights moved to the host and back)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout import model_runner as model_runner_module
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.kv_budget import (
    CPU_KV_BYTES,
    DeviceMemory,
    KVBudget,
    cpu_kv_bytes,
    probe_for,
)
from patrl.rollout.loader import iter_checkpoint
from patrl.rollout.models.causal_lm import CausalLM
from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import GroupCache
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MIB = 1 << 20


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in range(3, 3 + count)]


def _engine(model_dir: Path, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": 4,
        "num_kv_blocks": 128,
        "max_model_len": 256,
    }
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class FakeProbe:
    """A device of `total` bytes with `free` free after loading, whose profiling forward
    peaks at `activation` bytes; it runs the forward it is given."""

    def __init__(self, free: int, total: int, activation: int) -> None:
        self.memory = DeviceMemory(free, total)
        self.activation = activation
        self.profiled = 0

    def read(self) -> DeviceMemory:
        return self.memory

    def peak_during(self, fn: Callable[[], object]) -> int:
        fn()
        self.profiled += 1
        return self.activation


def _fake_device(monkeypatch: pytest.MonkeyPatch, probe: FakeProbe) -> None:
    monkeypatch.setattr(model_runner_module, "probe_for", lambda device: probe)


# ------------------------------------------------------------ KV from memory


def test_kv_budget_is_utilization_of_total_less_in_use_and_activations() -> None:
    budget = KVBudget(0.9, total=100 * MIB, in_use=30 * MIB, weights=20 * MIB,
                      activation=10 * MIB, profiled_tokens=2048)  # fmt: skip
    assert budget.kv_bytes == int(0.9 * 100 * MIB) - 30 * MIB - 10 * MIB
    assert KVBudget(0.5, 100 * MIB, 45 * MIB, 40 * MIB, 10 * MIB, 2048).kv_bytes == 0
    assert probe_for(torch.device("cpu")) is None


def test_cpu_default_holds_max_num_seqs_sequences_of_max_model_len(llama_dir: Path) -> None:
    """Without a device to measure, the cache is what the budgets can use: a tiny model gets a
    small one, not CPU_KV_BYTES; the budget caps a large one. An explicit size wins."""
    engine = _engine(llama_dir, num_kv_blocks=None, max_num_seqs=8, max_model_len=62)
    runner, spec = engine.runner, engine.cache.spec
    assert runner.kv_budget is None
    assert engine.cache.num_blocks == 8 * 16  # ceil(62 / 4) blocks for each of 8 sequences
    assert runner.kv_bytes == 8 * 16 * spec.bytes_per_block < CPU_KV_BYTES
    assert cpu_kv_bytes(spec.bytes_per_block, 4, 8, 62) == runner.kv_bytes
    assert cpu_kv_bytes(1 << 20, 16, 256, 4096) == CPU_KV_BYTES == 512 * MIB  # capped
    fixed = _engine(llama_dir, num_kv_blocks=None, kv_cache_memory_bytes=3 * MIB)
    assert fixed.cache.num_blocks == fixed.cache.spec.num_blocks_for(3 * MIB)


def test_cpu_default_runs_a_full_batch_of_the_longest_sequences_without_preempting(
    llama_dir: Path,
) -> None:
    """Slow twin: max_num_seqs different prompts, each generating to max_model_len, give the
    tokens of an engine with room to spare, and never preempt."""
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in range(5, 13)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    tight = _engine(llama_dir, num_kv_blocks=None, max_num_seqs=8, max_model_len=40)
    roomy = _engine(llama_dir, num_kv_blocks=256, max_num_seqs=8, max_model_len=40)
    out = tight.generate(batch, params)
    assert _tokens(out) == _tokens(roomy.generate(batch, params))
    assert all(len(p) + len(o.outputs[0].token_ids) == 40 for p, o in zip(batch, out, strict=True))
    assert tight.scheduler.num_preemptions == 0
    assert tight.cache.num_blocks == 8 * 10


def _cpu_default_at_two_tp_sizes(rank: int, world_size: int, model_dir: str) -> list[int]:
    config = EngineConfig(model=model_dir, block_size=4, max_model_len=64, max_num_seqs=4)
    both = GroupCache([1, 2], world_size=world_size, rank=rank)
    only_two = GroupCache([2], world_size=world_size, rank=rank)
    return [
        Engine(config, both.layout(1), both).cache.num_blocks,
        Engine(config, both.layout(2), both).cache.num_blocks,
        Engine(config, only_two.layout(2), only_two).cache.num_blocks,
    ]


@pytest.mark.multirank
def test_cpu_default_is_sized_at_the_smallest_tp_and_kept_across_layouts(
    llama_dir: Path,
) -> None:
    """Sized where a block holds the most heads (the smallest TP size the engine may use):
    at tp 2 the same bytes hold twice the blocks (2 KV heads, 1 a rank), so a fold never
    has less room than the layout it came from; a tp-2-only engine sizes at tp 2."""
    results = run_ranks(_cpu_default_at_two_tp_sizes, 2, args=(str(llama_dir),), timeout_s=300)
    assert results == [[4 * 16, 2 * 4 * 16, 4 * 16]] * 2


def test_kv_cache_sized_from_device_memory(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total, in_use, activation = 4 * MIB, 300_000, 50_000
    probe = FakeProbe(total - in_use, total, activation)
    _fake_device(monkeypatch, probe)
    seen: list[tuple[int, int]] = []
    forward = CausalLM.forward

    def spy(self: CausalLM, input_ids: torch.Tensor, ctx: Any) -> torch.Tensor:
        seen.append((input_ids.numel(), ctx.max_context_len))
        return forward(self, input_ids, ctx)

    monkeypatch.setattr(CausalLM, "forward", spy)
    engine = _engine(
        llama_dir, num_kv_blocks=None, gpu_memory_utilization=0.25, max_num_batched_tokens=64
    )
    budget = engine.runner.kv_budget
    assert budget is not None and probe.profiled == 1
    # the profiling forward: max_num_batched_tokens tokens, reading a max_model_len context
    assert seen == [(64, 256)]
    weights = sum(p.nbytes for p in engine.model.parameters())
    assert (budget.total, budget.in_use, budget.weights, budget.activation) == (
        total,
        in_use,
        weights,
        activation,
    )
    expected = (int(0.25 * total) - in_use - activation) // engine.cache.spec.bytes_per_block
    assert engine.cache.num_blocks == expected
    # a cache of that many blocks generates what a fixed one does
    batch = _prompts(6, seed=1)
    reference = _engine(llama_dir, num_kv_blocks=expected).generate(batch, GREEDY)
    assert _tokens(engine.generate(batch, GREEDY)) == _tokens(reference)


def test_too_small_a_memory_budget_names_the_numbers(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = 4 * MIB
    _fake_device(monkeypatch, FakeProbe(total - 900_000, total, 100_000))
    with pytest.raises(ValueError) as err:
        _engine(llama_dir, num_kv_blocks=None, gpu_memory_utilization=0.25)
    message = str(err.value)
    for part in (
        "max_model_len=256",
        "gpu_memory_utilization=0.25",
        "total",
        "in use after loading",
        "weights",
        "free",
        "activations",
        "Raise gpu_memory_utilization",
        "kv_cache_memory_bytes",
    ):
        assert part in message, (part, message)


def test_explicit_sizes_skip_the_measurement(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = FakeProbe(0, 4 * MIB, 0)  # would leave no KV at all
    _fake_device(monkeypatch, probe)
    assert _engine(llama_dir).cache.num_blocks == 128
    fixed = _engine(llama_dir, num_kv_blocks=None, kv_cache_memory_bytes=MIB)
    assert fixed.cache.num_blocks == fixed.cache.spec.num_blocks_for(MIB)
    assert probe.profiled == 0


def _uneven_devices(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    total = 4 * MIB
    in_use = 300_000 + 200_000 * rank  # rank 1's device is fuller
    model_runner_module.probe_for = lambda device: FakeProbe(total - in_use, total, 50_000)  # type: ignore[assignment]
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    config = EngineConfig(
        model=model_dir, block_size=4, max_model_len=256, gpu_memory_utilization=0.25
    )
    replica = Engine(config, groups.layout(1), groups)  # the world agrees
    grouped = Engine(config, groups.layout(2))  # the TP group agrees
    spec = replica.cache.spec
    return {
        "own": (int(0.25 * total) - in_use - 50_000) // spec.bytes_per_block,
        "replica": replica.cache.num_blocks,
        "grouped_bytes": grouped.runner.kv_bytes,
        "replica_bytes": replica.runner.kv_bytes,
    }


@pytest.mark.multirank
def test_ranks_take_the_smallest_measured_budget(llama_dir: Path) -> None:
    # a fold joins ranks into one TP group, whose caches must hold the same blocks
    results = run_ranks(_uneven_devices, 2, args=(str(llama_dir),), timeout_s=300)
    assert results[0]["own"] > results[1]["own"]
    for r in results:
        assert r["replica"] == results[1]["own"]
        assert r["grouped_bytes"] == r["replica_bytes"] == results[1]["replica_bytes"]


def test_gpu_memory_utilization_is_a_fraction(llama_dir: Path) -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model=str(llama_dir), gpu_memory_utilization=bad)


# ---------------------------------------------------------- sleep / wake_up


def test_sleep_frees_the_kv_cache_and_wake_up_generates_the_same(llama_dir: Path) -> None:
    first, second = _prompts(6, seed=1), _prompts(5, seed=2)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    plain = _engine(llama_dir)
    expected = [_tokens(plain.generate(first, GREEDY)), _tokens(plain.generate(second, sampled))]

    engine = _engine(llama_dir)
    got = [_tokens(engine.generate(first, GREEDY))]
    cache = engine.cache
    nbytes, pool = cache.nbytes, cache.pool
    assert nbytes > 0
    engine.sleep()
    assert pool.untyped_storage().nbytes() > 0  # the test's own reference keeps it alive
    assert cache.nbytes == 0 and cache.pool.numel() == 0 and not cache.k and not cache.v
    assert engine.cache.pool.untyped_storage().nbytes() == 0
    del pool
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(second, sampled)
    for rid in engine.request_ids():  # the failed generate left its requests queued
        engine.abort(rid)
    engine.step()
    assert not engine.has_unfinished()
    engine.wake_up()
    assert engine.cache is cache and cache.nbytes == nbytes
    assert cache.blocks.num_free_blocks == cache.num_blocks
    got.append(_tokens(engine.generate(second, sampled)))
    assert got == expected
    engine.wake_up()  # awake: a no-op
    assert engine.cache.nbytes == nbytes


def test_sleep_needs_an_idle_cache_and_a_known_level(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)
    engine.add_request(_prompts(1, seed=3)[0], GREEDY)
    engine.step()  # the prompt's KV is in the cache
    with pytest.raises(RuntimeError, match="idle"):
        engine.sleep()
    while engine.has_unfinished():
        engine.step()
    engine.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep()
    with pytest.raises(RuntimeError, match="import_requests on an engine asleep"):
        engine.import_requests([])


def test_sleep_level_2_moves_the_weights_out_and_back_bit_exact(llama_dir: Path) -> None:
    batch = _prompts(6, seed=4)
    engine = _engine(llama_dir)
    before = _tokens(engine.generate(batch, GREEDY))
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.sleep(level=2)
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert engine.runner._host_weights is not None
    assert engine.runner._host_weights.nbytes >= sum(w.nbytes for w in weights.values())
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.load_weights(iter_checkpoint(llama_dir), version=1)
    engine.wake_up()
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert _tokens(engine.generate(batch, GREEDY)) == before


def test_level_1_sleep_keeps_the_weights_loadable(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    engine.sleep()
    engine.load_weights(((n, t * 0.5) for n, t in iter_checkpoint(llama_dir)), version=3)
    engine.wake_up()
    fresh = _engine(llama_dir)
    fresh.load_weights(((n, t * 0.5) for n, t in iter_checkpoint(llama_dir)), version=3)
    batch = _prompts(4, seed=5)
    assert _tokens(engine.generate(batch, GREEDY)) == _tokens(fresh.generate(batch, GREEDY))


# ---------------------------------------------------------------------- GPU


def _cuda_engine(model_dir: Path, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = {"model": str(model_dir), "device": "cuda", "max_model_len": 256}
    return Engine(EngineConfig(**{**kwargs, **overrides}))


@pytest.mark.gpu
def test_gpu_sleep_gives_back_the_kv_and_weight_memory(llama_dir: Path) -> None:
    engine = _cuda_engine(llama_dir, kv_cache_memory_bytes=256 * MIB)
    batch = _prompts(4, seed=6)
    before = _tokens(engine.generate(batch, GREEDY))
    kv = engine.cache.nbytes
    weights = sum(p.nbytes for p in engine.model.parameters())
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep(level=1)
    assert torch.cuda.memory_allocated() <= awake - kv
    engine.wake_up()
    assert torch.cuda.memory_allocated() >= awake - MIB
    engine.sleep(level=2)
    assert torch.cuda.memory_allocated() <= awake - kv - weights
    engine.wake_up()
    assert torch.cuda.memory_allocated() >= awake - MIB
    assert _tokens(engine.generate(batch, GREEDY)) == before


@pytest.mark.gpu
def test_gpu_kv_sized_from_memory_stays_within_the_utilization(llama_dir: Path) -> None:
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = round(min(0.5, (total - free) / total + 0.2), 3)
    engine = _cuda_engine(llama_dir, gpu_memory_utilization=utilization)
    budget = engine.runner.kv_budget
    assert budget is not None and budget.activation > 0
    assert engine.cache.nbytes <= budget.kv_bytes
    assert engine.cache.nbytes >= budget.kv_bytes - engine.cache.spec.bytes_per_block
    torch.cuda.synchronize()
    slack = 64 * MIB  # the allocator's rounding and the CUDA context's own growth
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= utilization * total + slack, (used, utilization * total)
    assert torch.cuda.memory_reserved() <= utilization * total + slack
    out = engine.generate(_prompts(4, seed=7), GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
