"""benchmarks/multi_turn_bench.py's four modes compute the same trajectories (greedy), so its
times compare like with like: the agent loop with kept KV, the agent loop over the prefix cache,
its twin that re-prefills the whole conversation every turn, and its twin that moves the batch
in lock step on tool calls. Its prefill counts say what they claim: the re-prefilling twin
prefills every submitted token, the prefix-cached loop the new tokens and less than one KV
block more, the kept-KV loop exactly the new tokens. No timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_turn_bench.py"
BLOCK = 4


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("multi_turn_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def test_the_modes_compute_the_same_trajectories_and_count_prefill_as_claimed(
    tmp_path: Path,
) -> None:
    bench = load_bench()
    from patrl.rollout import Engine, EngineConfig

    model = bench.random_model(tmp_path / "model")
    plans = bench.make_plans(6, 3, 3, 40, 8, 2.0, bench.RANDOM_MODEL["vocab_size"])

    def engine(prefix_caching: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=str(model),
                dtype="float32",
                device="cpu",
                block_size=BLOCK,
                num_kv_blocks=1024,
                max_model_len=1024,
                enable_prefix_caching=prefix_caching,
            )
        )

    runs = {
        mode: bench.rollout(engine(mode != "reprefill"), mode, plans, workers=6)
        for mode in bench.MODES
    }
    reference = runs["kept_kv"]["trajectories"]
    assert len(reference) == 6
    for mode, run in runs.items():
        assert run["trajectories"] == reference, mode  # tokens exactly
        assert run["generated_tokens"] == sum(sum(p.turn_lengths) for p in plans)
    for t, turn in runs["reprefill"]["per_turn"].items():
        assert turn["prefilled"] == turn["submitted"], t  # the whole conversation again
    for mode in ("agent_loop", "blocking_batch"):
        for t, turn in runs[mode]["per_turn"].items():
            assert turn["new"] == 8 + 1  # the tool's ids and the last sampled token
            assert turn["new"] <= turn["prefilled"] < turn["new"] + BLOCK, (mode, t)
    # the engines' own counters agree: prompts (a group's once where cached) + continuations
    continuations = sum(turn["submitted"] * 6 for turn in runs["reprefill"]["per_turn"].values())
    assert runs["reprefill"]["prefilled_tokens"] == pytest.approx(6 * 40 + continuations)
    assert runs["agent_loop"]["prefilled_tokens"] < runs["reprefill"]["prefilled_tokens"] / 2
    # kept KV: every continuation prefills exactly its new tokens, the first turns as cached
    cached = runs["agent_loop"]
    first_turns = cached["prefilled_tokens"] - sum(
        (turn["prefilled"]) * 6 for turn in cached["per_turn"].values()
    )
    continuations = 6 * len(cached["per_turn"])
    assert runs["kept_kv"]["prefilled_tokens"] == first_turns + continuations * (8 + 1)
    assert runs["kept_kv"]["prefilled_tokens"] < cached["prefilled_tokens"]  # partial blocks
