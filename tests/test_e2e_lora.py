"""A 2-rank LoRA GRPO run through the real loop: adapters train, the engine gets only them
(its base never changes), it folds to TP 2 with them, each checkpoint holds a PEFT adapter
directory and a merged Hugging Face model, and the run resumes on another number of ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl.rollout import AdaptiveEngine, SamplingParams
from patrl.rollout.layers.lora import is_merged
from patrl.trainer import PolicyBatch
from patrl_testkit.jobs import learning_job_extras, tiny_job_overrides
from patrl_testkit.multirank import run_ranks
from patrl_testkit.profiles import synthetic_profile

peft = pytest.importorskip("peft", reason="peft is a test dependency (noxfile TEST_DEPS)")


def _extra(assets: Path, run_dir: Path, steps: int) -> dict[str, object]:
    return {
        **learning_job_extras(assets),
        "model.lora_rank": 8,
        "model.lora_alpha": 16,
        "actor.optim.lr": 1e-2,
        "rollout.adaptive_tp.enable": "true",
        "rollout.adaptive_tp.profile": run_dir / "profile.json",
        "trainer.total_training_steps": steps,
        "trainer.save_freq": 2,
    }


def _run(rank: int, world_size: int, assets: Path, run_dir: Path, steps: int = 2) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    if rank == 0 and world_size > 1:  # tp 2 always pays: the rollouts fold, adapters and all
        synthetic_profile(str(assets / "model"), tp2_speedup=20.0).save(run_dir / "profile.json")
    if world.distributed:
        torch.distributed.barrier()
    config = load_config(
        None, tiny_job_overrides(assets, run_dir, **_extra(assets, run_dir, steps))
    )
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)

    # the one-layout engine holds the model (wrapped by an AdaptiveEngine on 2 ranks; one rank
    # has nothing to fold and runs it plain)
    wrapped = loop.engine.engine if isinstance(loop.engine, AdaptiveEngine) else loop.engine
    assert isinstance(loop.engine, AdaptiveEngine) == (world_size > 1)

    def base() -> dict[str, torch.Tensor]:
        return {n: p.clone() for n, p in wrapped.model.named_parameters() if "lora_" not in n}

    before = base()
    result = loop.run()
    after = base()
    prompt = [1, 70, 71]
    out = loop.engine.generate([prompt], SamplingParams(seed=5, max_tokens=8, ignore_eos=True))
    sample = out[0].outputs[0]
    batch = PolicyBatch.from_responses([prompt], [sample.token_ids], [0.0])
    trainer_lp = loop.trainer.compute_logprobs(batch)[0][-len(sample.token_ids) :]
    adapters = {n for b in loop.trainer.iter_full_weights(1 << 30) for n, _ in b}
    return {
        "history": result.history,
        "steps": result.steps,
        "gap": float((trainer_lp - torch.tensor(sample.logprobs)).abs().max()),
        "base_same_layout": before.keys() == after.keys()
        and all(before[n].shape == after[n].shape for n in before),
        "base_unchanged": all(
            torch.equal(before[n], after[n])
            for n in before
            if n in after and before[n].shape == after[n].shape
        ),
        "synced_only_adapters": all(".lora_" in n for n in adapters),
    }


@pytest.mark.e2e
@pytest.mark.multirank
def test_two_rank_lora_grpo_run(assets: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    results = run_ranks(_run, world_size=2, args=(assets, tmp_path), timeout_s=400)
    steps = [h for h in results[0]["history"] if "actor/pg_loss" in h]
    assert [h["step"] for h in steps] == [1.0, 2.0]
    assert all(h["actor/grad_norm"] > 0 for h in steps)
    assert all(h["rollout/tp_max"] == 2 for h in steps)  # the adapters went through a fold
    for r in results:
        assert r["synced_only_adapters"]
        assert r["gap"] < 1e-4, r["gap"]  # the engine holds the trainer's adapters
        assert r["base_unchanged"], "the engine's base weights changed"
    ckpt = tmp_path / "global_step_2"
    adapter = ckpt / "trainer" / "lora_adapter"
    base = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "huggingface", dtype=torch.float32)
    ids = torch.tensor([[1, 70, 71, 72, 73]])
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        # the checkpoint's HF model is the merged one (its dtype the source's), not the base
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        with loaded.disable_adapter():  # from_pretrained adapted `base` in place
            assert (loaded(input_ids=ids).logits - want).abs().max() > 1e-3
    # The world-size change, as for full runs: the 2-rank checkpoint resumes on 1 rank (DCP
    # reshards the adapters and their AdamW state), the engine gets the resumed adapters and
    # step 3 trains on.
    resumed = _run(0, 1, assets, tmp_path, steps=3)
    assert resumed["steps"] == 3
    # the run's history: the 2-rank steps read back from its metrics, then the resumed step
    assert [h["step"] for h in resumed["history"] if "actor/pg_loss" in h] == [1.0, 2.0, 3.0]
    assert resumed["synced_only_adapters"] and resumed["base_unchanged"]
    assert resumed["gap"] < 1e-4, resumed["gap"]
    # step 3 sampled with the resumed adapters: its rollout probabilities are the trainer's
    (last,) = [h for h in resumed["history"] if h["step"] == 3.0 and "actor/pg_loss" in h]
    assert last["training/rollout_probs_diff_max"] < 1e-4, last


def _random_adapter(model_dir: Path, out: Path, rank: int) -> Path:
    """A PEFT adapter of `model_dir` (all-linear, r=`rank`) whose A and B are random: a
    policy unlike the base."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    )
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(tuple(p.shape), generator=g) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("merge", [False, True])
def test_a_run_from_an_adapter_gives_it_to_the_engine_before_the_first_rollout(
    assets: Path, tmp_path: Path, merge: bool
) -> None:
    """model.lora_adapter_path: the trainer starts from the adapter, and so must the engine
    (it loads model.path, the base): the schedule's start syncs it, so the first rollout
    samples from the trainer's policy; also in merged mode (model.lora.merge)."""
    adapter = _random_adapter(assets / "model", tmp_path / "adapter", rank=4)
    extra = {
        "model.lora_rank": 4,
        "model.lora_alpha": 8,
        "model.lora_adapter_path": adapter,
        "model.lora.merge": str(merge).lower(),
    }
    config = load_config(None, tiny_job_overrides(assets, tmp_path / "run", **extra))
    world = World(0, 1, 0, torch.device("cpu"))
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    loop.begin()  # as RunLoop.run calls it, before the first validation and step
    # the one-layout engine holds the model (wrapped by an AdaptiveEngine under adaptive TP)
    engine = loop.engine.engine if isinstance(loop.engine, AdaptiveEngine) else loop.engine
    assert is_merged(engine.model) == merge
    prompt = [1, 70, 71]
    out = loop.engine.generate([prompt], SamplingParams(seed=5, max_tokens=8, ignore_eos=True))
    sample = out[0].outputs[0]
    batch = PolicyBatch.from_responses([prompt], [sample.token_ids], [0.0])
    trainer_lp = loop.trainer.compute_logprobs(batch)[0][-len(sample.token_ids) :]
    assert float((trainer_lp - torch.tensor(sample.logprobs)).abs().max()) < 1e-4
    # and that policy is not the base's: the engine holds the adapter's non-zero B
    engine_b = [p for n, p in engine.model.named_parameters() if n.endswith("lora_B")]
    assert engine_b and all(float(p.abs().max()) > 0 for p in engine_b)


def _async_run(rank: int, world_size: int, assets: Path, run_dir: Path) -> dict[str, Any]:
    from patrl.orchestrator.async_loop import AsyncGRPO
    from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker

    world = World(rank, world_size, rank, torch.device("cpu"))
    extra = {
        **learning_job_extras(assets),
        "model.lora_rank": 8,
        "model.lora_alpha": 16,
        "actor.optim.lr": 1e-2,
        "trainer.mode": "async",
        "async_rl.max_staleness": 0,
        "async_rl.rollout_ranks": 1,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        # from an adapter: the rollout rank must get it before its first rollout
        "model.lora_adapter_path": run_dir / "adapter",
    }
    config = load_config(None, tiny_job_overrides(assets, run_dir, **extra))
    loop = AsyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    result = loop.run()
    if not isinstance(loop.role, TrainerWorker):
        from patrl.rollout.loader import load_model

        fresh = dict(load_model(assets / "model", dtype=torch.float32).named_parameters())
        engine = dict(loop.role.engine.model.named_parameters())
        base = [n for n in engine if "lora_" not in n]
        return {
            "role": "rollout",
            "base_unchanged": base == list(fresh)
            and all(torch.equal(engine[n], fresh[n]) for n in base),
        }
    store = loop.role.job.weights
    return {
        "role": "trainer",
        "history": result.history,
        "published": {n for v in store.versions() for n, _ in store.load(v)},
    }


@pytest.mark.e2e
@pytest.mark.multirank
def test_lora_in_the_async_schedule(assets: Path, tmp_path: Path) -> None:
    """1 rollout + 1 trainer rank at max_staleness=0, from a PEFT adapter: the trainer
    publishes adapters only (the start's too), the rollout engine (built with adapters) samples
    with exactly the trainer's policy from step 1 on (decoupled PPO's behaviour weight is 1)
    and its base never changes."""
    _random_adapter(assets / "model", tmp_path / "adapter", rank=8)
    results = run_ranks(_async_run, world_size=2, args=(assets, tmp_path), timeout_s=400)
    assert [r["role"] for r in results] == ["rollout", "trainer"]
    steps = [h for h in results[1]["history"] if "actor/pg_loss" in h]
    assert [h["step"] for h in steps] == [1.0, 2.0]
    assert results[1]["published"] and all(".lora_" in n for n in results[1]["published"])
    for h in steps:
        assert h["actor/grad_norm"] > 0
        assert h["actor/behav_imp_weight"] == pytest.approx(1.0, abs=1e-4), h
    assert results[0]["base_unchanged"]
