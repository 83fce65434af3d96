"""LoRA through the job: verl's keys, preflight's refusals, and a trainer-to-engine sync that
moves only the adapters and never touches the engine's base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.orchestrator.build import engine_lora, trainer_config
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.preflight import lora_problems
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.layers.lora import is_merged, unmerge_lora
from patrl.trainer import PolicyBatch, Trainer
from patrl_testkit.models import save_tiny_model

peft = pytest.importorskip("peft", reason="peft is a test dependency (noxfile TEST_DEPS)")

VOCAB = 128
RANK = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("orch_lora")
    return save_tiny_model(root / "base", "llama", "plain", vocab_size=VOCAB)


def _job(*overrides: str) -> object:
    return load_config(None, ["data.train_files=/d.jsonl", *overrides])


def test_verl_keys_reach_the_trainer_and_the_engine() -> None:
    config = _job(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,layers.1.mlp.down_proj]",
        "actor_rollout_ref.model.exclude_modules=.*layers\\.0\\..*",
    )
    lora = trainer_config(config).lora  # type: ignore[arg-type]
    assert (lora.lora_rank, lora.lora_alpha) == (8, 32.0)
    assert lora.target_modules == ["q_proj", "layers.1.mlp.down_proj"]
    assert lora.exclude_modules == ".*layers\\.0\\..*"
    assert engine_lora(config) == {  # type: ignore[arg-type]
        "lora_rank": 8,
        "lora_alpha": 32.0,
        "lora_target_modules": ["down_proj", "q_proj"],
        "lora_merged": False,
    }
    assert trainer_config(_job()).lora.lora_rank == 0  # type: ignore[arg-type]
    assert engine_lora(_job()) == {}  # type: ignore[arg-type]


def test_actor_lora_is_refused_for_the_model_keys() -> None:
    with pytest.raises(ConfigError, match=r"model\.lora_rank"):
        _job("actor.lora.lora_rank=4")


def test_preflight_names_the_key_and_the_accepted_values(base_dir: Path, tmp_path: Path) -> None:
    path = f"model.path={base_dir}"
    [msg] = lora_problems(_job(path, "model.lora_rank=-2"), str(base_dir))  # type: ignore[arg-type]
    assert "model.lora_rank=-2" in msg and "accepted: 0 (LoRA off) or a positive rank" in msg
    job = _job(path, "model.lora_rank=4", "model.target_modules=[q_proj,qkv]")
    [msg] = lora_problems(job, str(base_dir))  # type: ignore[arg-type]
    assert "model.target_modules" in msg and "['qkv']" in msg and "'q_proj'" in msg
    job = _job(path, "model.lora_rank=4", "model.target_modules=[lm_head]")
    [msg] = lora_problems(job, str(base_dir))  # type: ignore[arg-type]
    assert "lm_head" in msg and "accepted: 'all-linear' or names among" in msg
    job = _job(path, "model.lora_adapter_path=/x")
    [msg] = lora_problems(job, str(base_dir))  # type: ignore[arg-type]
    assert "model.lora_adapter_path=/x needs model.lora_rank > 0" in msg
    assert lora_problems(_job(path, "model.lora_rank=4"), str(base_dir)) == []  # type: ignore[arg-type]


def test_preflight_refuses_an_adapter_of_another_base_model(base_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    other = save_tiny_model(
        tmp_path / "other", "llama", "plain", vocab_size=VOCAB, intermediate_size=96
    )
    cfg = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules="all-linear")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(other), cfg)
    model.save_pretrained(tmp_path / "adapter")
    job = _job(
        f"model.path={base_dir}",
        f"model.lora_rank={RANK}",
        f"model.lora_adapter_path={tmp_path / 'adapter'}",
    )
    problems = lora_problems(job, str(base_dir))  # type: ignore[arg-type]
    assert any("base model" in p and "differs from model.path" in p for p in problems), problems
    assert any("mlp" in p and "needs" in p for p in problems), problems
    wrong_rank = _job(
        f"model.path={base_dir}",
        "model.lora_rank=8",
        f"model.lora_adapter_path={tmp_path / 'adapter'}",
    )
    [msg] = lora_problems(wrong_rank, str(base_dir))  # type: ignore[arg-type]
    assert "r=4" in msg and "model.lora_rank=8" in msg


def _engine_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    ctx = AttentionContext.build([len(ids)], [len(ids)])
    with torch.no_grad():
        model = engine.model
        return model.compute_logits(model(torch.tensor(ids), ctx))


def test_the_sync_moves_only_adapters_and_the_engine_base_never_changes(base_dir: Path) -> None:
    job = _job(f"model.path={base_dir}", f"model.lora_rank={RANK}", "model.lora_alpha=8")
    cfg = trainer_config(job)  # type: ignore[arg-type]
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 1e-2})})
    trainer = Trainer(cfg, base_dir)
    engine = Engine(
        EngineConfig(
            model=str(base_dir),
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            **engine_lora(job),  # type: ignore[arg-type]
        )
    )
    base = {n: p.clone() for n, p in engine.model.named_parameters() if "lora_" not in n}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    base_logits = _engine_logits(engine, ids)
    adapter_bytes = sum(
        p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if ".lora_" in n
    )
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    for step in range(2):
        batch = PolicyBatch.from_responses([ids[:4]] * 2, [ids[4:], ids[6:]], [1.0, -1.0])
        trainer.train_step(batch)
        pairs = [pair for bucket in trainer.iter_full_weights(1 << 20) for pair in bucket]
        engine.load_weights(pairs, version=step + 1)
        sent = sum(t.numel() * t.element_size() for _, t in pairs)
        names = {n for n, _ in pairs}
        assert sent == adapter_bytes < full_bytes / 10
        assert all(".lora_A." in n or ".lora_B." in n for n in names)
        for n, p in engine.model.named_parameters():
            if "lora_" not in n:
                assert torch.equal(p, base[n]), n
        with torch.no_grad():
            want = trainer.model(input_ids=torch.tensor([ids])).logits[0]
        got = _engine_logits(engine, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (got - base_logits).abs().max() > 1e-2  # the adapters moved the policy


def test_merged_mode_is_verls_lora_merge(base_dir: Path) -> None:
    """`model.lora.merge` (verl's `actor_rollout_ref.model.lora.merge`) puts the engine in
    merged mode; preflight names the keys where it cannot be."""
    job = _job("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true")
    assert engine_lora(job)["lora_merged"] is True  # type: ignore[arg-type]
    path = f"model.path={base_dir}"
    [msg] = lora_problems(_job(path, "model.lora.merge=true"), str(base_dir))  # type: ignore[arg-type]
    assert "model.lora.merge=true needs model.lora_rank > 0" in msg
    adaptive = _job(
        path, "model.lora_rank=4", "model.lora.merge=true", "rollout.adaptive_tp.enable=true"
    )
    [msg] = lora_problems(adaptive, str(base_dir))  # type: ignore[arg-type]
    assert "model.lora.merge=true" in msg and "rollout.adaptive_tp.enable=false" in msg
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        _job("model.lora.rank=4")  # verl's Megatron rank key: patrl's is model.lora_rank


def test_merged_mode_syncs_adapters_and_unmerges_to_the_exact_base(base_dir: Path) -> None:
    """In merged mode each adapter-only sync unmerges, loads and merges again: the engine's
    logits are the trainer's after every step, and unmerging after several syncs gives back
    the base weights bit for bit (no update folded in twice, no round-off left behind)."""
    job = _job(
        f"model.path={base_dir}", f"model.lora_rank={RANK}", "model.lora_alpha=8",
        "model.lora.merge=true",
    )  # fmt: skip
    cfg = trainer_config(job)  # type: ignore[arg-type]
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 1e-2})})
    trainer = Trainer(cfg, base_dir)
    engine = Engine(
        EngineConfig(
            model=str(base_dir),
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            **engine_lora(job),  # type: ignore[arg-type]
        )
    )
    assert is_merged(engine.model)
    base = {n: p.clone() for n, p in engine.model.named_parameters() if "lora_" not in n}
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(3):
        batch = PolicyBatch.from_responses([ids[:4]] * 2, [ids[4:], ids[6:]], [1.0, -1.0])
        trainer.train_step(batch)
        pairs = [pair for bucket in trainer.iter_full_weights(1 << 20) for pair in bucket]
        assert all(".lora_A." in n or ".lora_B." in n for n, _ in pairs)
        engine.load_weights(pairs, version=step + 1)
        assert is_merged(engine.model)
        with torch.no_grad():
            want = trainer.model(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_engine_logits(engine, ids), want, rtol=1e-4, atol=1e-4)
    merged = [
        n for n, p in engine.model.named_parameters() if n in base and not torch.equal(p, base[n])
    ]
    assert merged  # the adapters are folded into the weights
    unmerge_lora(engine.model)
    for n, p in engine.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n


def test_critic_lora_keys_reach_the_critic_and_preflight_names_them(base_dir: Path) -> None:
    """verl's critic.model.lora_rank / lora_alpha / target_modules: the critic's trainer gets
    them (tested against PEFT in test_trainer_lora); a target matching nothing is a preflight
    problem naming the critic's key."""
    from patrl.orchestrator.build import critic_config

    gae = ("algorithm.adv_estimator=gae", f"model.path={base_dir}")
    job = _job(*gae, "critic.model.lora_rank=4", "critic.model.lora_alpha=8")
    lora = critic_config(job).lora  # type: ignore[arg-type]
    assert (lora.lora_rank, lora.lora_alpha, lora.target_modules) == (4, 8.0, "all-linear")
    assert critic_config(_job(*gae)).lora.lora_rank == 0  # type: ignore[arg-type]
    assert trainer_config(job).lora.lora_rank == 0  # type: ignore[arg-type]  # the actor's own
    assert lora_problems(job, str(base_dir)) == []  # type: ignore[arg-type]
    bad = _job(*gae, "critic.model.lora_rank=4", "critic.model.target_modules=[q_proj,qkv]")
    [msg] = lora_problems(bad, str(base_dir))  # type: ignore[arg-type]
    assert msg.startswith("critic.model.target_modules") and "['qkv']" in msg
    with pytest.raises(ConfigError, match=r"critic\.model\.lora_rank"):
        _job("critic.model.lora_rank=-1")
