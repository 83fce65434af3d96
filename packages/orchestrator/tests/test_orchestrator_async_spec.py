"""The async schedule's speculation metrics: its groups carry the drafter counts of the
interval before each hand-over, and a step's row sums them into the sync loop's
`rollout/spec_*` metrics.

Twin: the sync loop's computation, `speculation_metrics` between two `Engine.stats()` taken
around the same rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.orchestrator.async_rl.tickets import GroupRecord, spec_metrics, spec_totals
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.drafter import speculation_metrics
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_tiny_model


def test_summed_group_counts_give_the_sync_loops_metrics(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    engine = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            block_size=4,
            num_kv_blocks=256,
            max_model_len=256,
            speculative={"enable": True, "max_num_seqs": 0},
        )
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (6 + i,), generator=g).tolist() for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    keys = [f"train/{i}" for i in range(3)]
    engine.generate(prompts, greedy, prompt_keys=keys)  # history for the next rollouts

    before, seen = engine.stats(), spec_totals(engine.drafter)
    records = []
    for i in range(3):  # three hand-overs, each carrying its interval's counts
        engine.generate([prompts[i]], greedy, prompt_keys=[keys[i]])
        now = spec_totals(engine.drafter)
        counts = {k: v - seen[k] for k, v in now.items()}
        seen = now
        records.append(GroupRecord(i, 0, [], [], {}, spec_counts=counts))
    want = speculation_metrics(before, engine.stats())
    got = spec_metrics(records)
    assert want["rollout/spec_acceptance"] > 0  # the history drafts were accepted
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k


def test_no_counts_no_metrics() -> None:
    assert spec_totals(None) == {}
    assert spec_metrics([GroupRecord(0, 0, [], [], {})]) == {}
