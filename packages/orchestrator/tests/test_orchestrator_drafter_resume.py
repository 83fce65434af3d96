"""The speculation drafter's history travels in run checkpoints: an engine resumed from one
drafts from the same earlier responses as the engine that never stopped, on every
data-parallel replica; a resume on another layout gets every replica's history merged, and
the async trainer's history of trained groups is what its rollout ranks draft from.

Twin: the uninterrupted engine (same drafts accepted by source, same tokens); control: a
fresh engine without the checkpoint drafts nothing from history."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from patrl.orchestrator.distributed import World
from patrl.orchestrator.drafter_checkpoint import (
    DRAFTER_FILE,
    gather_drafter,
    load_drafter,
    remember_samples,
    save_drafter,
)
from patrl.orchestrator.scoring import Sample
from patrl.orchestrator.sync_loop import SyncSchedule, measured_tail
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.drafter import Drafter
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_tiny_model
from patrl_testkit.multirank import run_ranks

ONE = World(0, 1, 0, torch.device("cpu"))

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
KEYS = [f"train/{i}" for i in range(3)]


def new_engine(model: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            block_size=4,
            num_kv_blocks=256,
            max_model_len=256,
            speculative={"enable": True, "max_num_seqs": 0},
        )
    )


def rollout(
    engine: Engine, prompts: list[list[int]], keys: list[str] | None = KEYS
) -> tuple[list[list[int]], dict[str, float]]:
    """One step's greedy rollout under the prompts' keys (None: none, as the async rollout
    ranks send them): its tokens and the drafter counts it added."""
    before = engine.stats()
    out = engine.generate(prompts, GREEDY, prompt_keys=keys)
    after = engine.stats()
    counts = {k: after[k] - before[k] for k in after if k.startswith("spec_accepted_tokens/")}
    counts["spec_drafted_tokens"] = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    return [o.outputs[0].token_ids for o in out], counts


def test_a_resumed_engine_drafts_from_the_same_history_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (6 + i,), generator=g).tolist() for i in range(3)]

    uninterrupted = new_engine(model)
    rollout(uninterrupted, prompts)
    saved = new_engine(model)
    rollout(saved, prompts)
    checkpoint = tmp_path / "global_step_1"
    checkpoint.mkdir()
    save_drafter(gather_drafter(saved.drafter, ONE), checkpoint)
    assert (checkpoint / DRAFTER_FILE).is_file()

    resumed, fresh = new_engine(model), new_engine(model)
    load_drafter(resumed.drafter, checkpoint)
    assert uninterrupted.drafter is not None and resumed.drafter is not None
    assert resumed.drafter.state_dict() == uninterrupted.drafter.state_dict()
    assert resumed.drafter.state_dict()["history"]  # something to draft from

    want, want_counts = rollout(uninterrupted, prompts)
    got, got_counts = rollout(resumed, prompts)
    assert got == want
    assert got_counts == want_counts
    assert got_counts["spec_accepted_tokens/history"] > 0
    _, fresh_counts = rollout(fresh, prompts)
    assert fresh_counts["spec_accepted_tokens/history"] == 0
    assert resumed.drafter.state_dict() == uninterrupted.drafter.state_dict()


def test_without_speculation_or_without_the_file_nothing_is_written_or_read(
    tmp_path: Path,
) -> None:
    save_drafter(None, tmp_path)
    assert not (tmp_path / DRAFTER_FILE).exists()
    load_drafter(None, tmp_path)  # a run resumed without speculation ignores the file
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    e = new_engine(model)
    load_drafter(e.drafter, tmp_path)  # a checkpoint saved without speculation
    assert e.drafter is not None and e.drafter.state_dict() == {"history": []}


def _replica_resume(rank: int, world_size: int, model: str, checkpoint: str) -> dict[str, Any]:
    """Rank `rank`, a replica of its own prompts: a rollout, a checkpoint of every rank's
    history (rank 0 writes it), then a fresh engine resumed from it next to the one that
    never stopped; both roll out the same prompts again."""
    import torch.distributed as dist

    world = World(rank, world_size, rank, torch.device("cpu"))
    g = torch.Generator().manual_seed(10 + rank)  # each replica its own prompts
    prompts = [torch.randint(0, 200, (6 + i,), generator=g).tolist() for i in range(3)]
    keys = [f"train/{rank}/{i}" for i in range(3)]
    uninterrupted = new_engine(Path(model))
    rollout(uninterrupted, prompts, keys)
    state = gather_drafter(uninterrupted.drafter, world)
    if rank == 0:
        save_drafter(state, Path(checkpoint))
    dist.barrier()
    resumed = new_engine(Path(model))
    load_drafter(resumed.drafter, Path(checkpoint), rank, world_size)
    assert resumed.drafter is not None and uninterrupted.drafter is not None
    same_state = resumed.drafter.state_dict() == uninterrupted.drafter.state_dict()
    want, want_counts = rollout(uninterrupted, prompts, keys)
    got, got_counts = rollout(resumed, prompts, keys)
    return {
        "same_state": same_state,
        "same_tokens": got == want,
        "same_counts": got_counts == want_counts,
        "history_accepted": got_counts["spec_accepted_tokens/history"],
        "keys": sorted(k for k, _ in resumed.drafter.state_dict()["history"]),
    }


@pytest.mark.multirank
def test_every_replica_resumes_its_own_history(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    checkpoint = tmp_path / "global_step_1"
    checkpoint.mkdir()
    per_rank = run_ranks(
        _replica_resume, world_size=2, args=(str(model), str(checkpoint)), timeout_s=240
    )
    for rank, got in enumerate(per_rank):
        assert got["same_state"] and got["same_tokens"] and got["same_counts"]
        assert got["history_accepted"] > 0
        assert got["keys"] == [f"train/{rank}/{i}" for i in range(3)]
    # on another layout (one rank, or a TP group of both), every rank gets both replicas'
    merged = Drafter(4)
    load_drafter(merged, checkpoint)
    assert sorted(k for k in merged.history) == sorted(per_rank[0]["keys"] + per_rank[1]["keys"])
    for rank in range(2):
        folded = Drafter(4)
        load_drafter(folded, checkpoint, rank, 2, tp_size=2)
        assert folded.state_dict() == merged.state_dict()


def test_merged_histories_keep_each_prompts_newest_responses() -> None:
    """Rank order, each prompt's newest `history_size`, the prompts bounded as one drafter
    bounds them; one state merges to itself."""
    a = {"history": [["p", [[1], [2]]], ["q", [[3]]]]}
    b = {"history": [["p", [[4], [5]]], [[7, 8], [[6]]]]}
    drafter = Drafter(4, history_size=3, history_prompts=2)
    assert drafter.merged_state([a]) == a
    assert drafter.merged_state([a, b]) == {"history": [["p", [[2], [4], [5]]], [[7, 8], [[6]]]]}


def test_a_checkpoint_of_one_replica_or_of_the_old_form_loads_everywhere(tmp_path: Path) -> None:
    state = {"history": [["p", [[1, 2, 3]]]]}
    torch.save(state, tmp_path / DRAFTER_FILE)  # the form before every replica was kept
    for rank, world, tp in ((0, 1, 1), (1, 2, 1), (1, 2, 2)):
        drafter = Drafter(4)
        load_drafter(drafter, tmp_path, rank, world, tp)
        assert drafter.state_dict() == state


def test_the_async_trainers_history_is_what_rollout_ranks_draft_from(tmp_path: Path) -> None:
    """The trainer remembers trained groups' complete responses under their prompt's token
    ids (aborted ones not); a rollout rank's engine, sending no prompt keys, resumed from
    that history drafts from it as from its own."""
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (6 + i,), generator=g).tolist() for i in range(3)]
    first = new_engine(model)
    tokens, _ = rollout(first, prompts, keys=None)
    samples = [
        Sample(i, p, t, [0.0] * len(t), "length", 0.0)
        for i, (p, t) in enumerate(zip(prompts, tokens, strict=True))
    ]
    samples.append(Sample(9, prompts[0], [1, 2, 3], [0.0] * 3, "abort", 0.0))
    trainer = Drafter(4)
    remember_samples(trainer, samples)
    remember_samples(None, samples)  # no speculation: nothing
    assert first.drafter is not None
    assert trainer.state_dict() == first.drafter.state_dict()
    save_drafter(trainer.state_dict(), tmp_path)
    resumed, fresh = new_engine(model), new_engine(model)
    load_drafter(resumed.drafter, tmp_path)
    got, counts = rollout(resumed, prompts, keys=None)
    want, want_counts = rollout(first, prompts, keys=None)
    assert got == want and counts == want_counts
    assert counts["spec_accepted_tokens/history"] > 0
    assert rollout(fresh, prompts, keys=None)[1]["spec_accepted_tokens/history"] == 0


def test_the_adaptive_planner_prices_the_tail_every_rank_measured() -> None:
    """Two ranks' running drafter counts summed: 30 accepted of 60 drafted over 100 sample
    steps (130 tokens) is acceptance 0.5, 1.3 tokens a step, 0.6 drafted a step; no step
    counted, no tail. The sync loop hands it to an adaptive engine's planner."""
    ranks = [
        {"spec_sample_steps": 40, "spec_emitted_tokens": 50, "spec_drafted_tokens": 20,
         "spec_accepted_tokens": 10, "timeline": []},
        {"spec_sample_steps": 60, "spec_emitted_tokens": 80, "spec_drafted_tokens": 40,
         "spec_accepted_tokens": 20},
    ]  # fmt: skip
    tail = measured_tail(ranks, 16)
    assert tail is not None and tail.max_num_seqs == 16
    assert (tail.acceptance, tail.tokens_per_step) == pytest.approx((0.5, 1.3))
    assert tail.draft_tokens == pytest.approx(0.6)
    assert measured_tail([{}, {"spec_sample_steps": 0}], 16) is None
    priced: list[Any] = []
    planner = SimpleNamespace(set_speculation=priced.append)
    loop = SimpleNamespace(
        engine=SimpleNamespace(controller=SimpleNamespace(planner=planner)),
        world=ONE,
        config=SimpleNamespace(
            rollout=SimpleNamespace(speculative=SimpleNamespace(enable=True, max_num_seqs=8))
        ),
    )
    SyncSchedule._price_speculation(loop, ranks[1])  # type: ignore[arg-type]
    assert priced == [measured_tail([ranks[1]], 8)]
    loop.engine = SimpleNamespace()  # a static engine: no planner, nothing priced
    SyncSchedule._price_speculation(loop, ranks[1])  # type: ignore[arg-type]
    assert len(priced) == 1
