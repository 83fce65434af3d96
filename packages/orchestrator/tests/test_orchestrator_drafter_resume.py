"""The speculation drafter's history travels in run checkpoints: an engine resumed from one
drafts from the same earlier responses as the engine that never stopped.

Twin: the uninterrupted engine (same drafts accepted by source, same tokens); control: a
fresh engine without the checkpoint drafts nothing from history."""

from __future__ import annotations

from pathlib import Path

import torch

from patrl.orchestrator.sync_loop import DRAFTER_FILE, load_drafter, save_drafter
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_tiny_model

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


def rollout(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, float]]:
    """One step's greedy rollout under the prompts' keys: its tokens and the drafter counts
    it added."""
    before = engine.stats()
    out = engine.generate(prompts, GREEDY, prompt_keys=KEYS)
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
    save_drafter(saved.drafter, checkpoint)
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
