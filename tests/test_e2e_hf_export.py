"""A run's Hugging Face model: a 2-rank GRPO run's final checkpoint holds `huggingface/`,
transformers' greedy `generate` on it gives the tokens patrl's engine gives on it, the export
CLI turns the checkpoint into the same directory, and 1 rank resumes the 2-rank run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.trainer.checkpoint import read_marker
from patrl.trainer.export import main as export_main
from patrl_testkit.jobs import addition_job
from patrl_testkit.multirank import run_ranks

PROMPTS = ["3+4=?", "9+1=?", "0+0=?"]
NEW_TOKENS = 8


def make_loop(assets: Path, run_dir: Path, world: World, steps: int) -> SyncGRPO:
    settings = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": 4,
        "actor.optim.lr": 1e-2,
        "rollout.n": 2,
        "rollout.adaptive_tp.enable": False,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 64,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 0,
        "trainer.logger": "[jsonl]",
        "trainer.plots": False,
        "trainer.default_local_dir": run_dir,
    }
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    return SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)


def _two_rank_run(rank: int, world_size: int, assets: Path, run_dir: Path) -> dict[str, Any]:
    loop = make_loop(assets, run_dir, World(rank, world_size, rank, torch.device("cpu")), 2)
    loop.run()
    weights = {n: t.numpy().copy() for b in loop.trainer.iter_full_weights(1 << 20) for n, t in b}
    return {"weights": weights}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()}


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            full = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
            )
        out.append(full[0, len(ids) :].tolist())
    return out


def _engine_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(
        EngineConfig(
            model=str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params)]


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_two_rank_run_writes_a_model_transformers_and_the_engine_agree_on(
    tmp_path: Path,
) -> None:
    assets = addition_job(tmp_path / "assets")
    run_dir = tmp_path / "runs"
    ranks = run_ranks(_two_rank_run, world_size=2, args=(assets, run_dir), timeout_s=400)
    job_dir = run_dir
    checkpoint = run_checkpoint.latest_checkpoint(job_dir)
    assert checkpoint == run_checkpoint.step_dir(job_dir, 2)
    hf = run_checkpoint.hf_dir(checkpoint)
    names = {p.name for p in hf.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert read_marker(checkpoint / run_checkpoint.TRAINER_DIR)["world_size"] == 2

    # The directory holds the trained weights, in the source model's dtype (fp32 here).
    exported = _tensors(hf)
    source = _tensors(assets / "model")
    trained = {n: torch.from_numpy(t) for n, t in ranks[0]["weights"].items()}
    assert exported.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(exported[name], t), name
    assert max(float((exported[n] - source[n]).abs().max()) for n in exported) > 1e-4

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    hf_tokens = _hf_greedy(hf, prompts)
    assert hf_tokens == _engine_greedy(hf, prompts)
    assert all(len(t) > 1 for t in hf_tokens)  # not an immediate EOS everywhere
    assert hf_tokens != _hf_greedy(assets / "model", prompts)  # training changed the outputs

    # The CLI, one process, from the 2-rank checkpoint: the same directory.
    out = tmp_path / "exported"
    assert export_main([str(checkpoint), str(out)]) == 0
    cli = _tensors(out)
    assert cli.keys() == exported.keys()
    assert all(torch.equal(cli[n], exported[n]) for n in exported)
    assert (out / "config.json").read_text() == (hf / "config.json").read_text()

    # One rank resumes the 2-rank run where it stopped and continues to step 3.
    loop = make_loop(assets, run_dir, World(0, 1, 0, torch.device("cpu")), 3)
    loop.resume()
    assert loop.step == 2
    for name, t in trained.items():
        assert torch.equal(dict(loop.trainer.model.named_parameters())[name].detach(), t), name
    result = loop.run()
    assert result.steps == 3
    # The run's metrics file continues: its rows of steps 1-2 (2 ranks), then step 3 (1 rank).
    assert [h["step"] for h in result.history if "critic/score/mean" in h] == [1.0, 2.0, 3.0]
    last = run_checkpoint.step_dir(job_dir, 3)
    assert read_marker(last / run_checkpoint.TRAINER_DIR)["world_size"] == 1
    assert _tensors(run_checkpoint.hf_dir(last)).keys() == exported.keys()
