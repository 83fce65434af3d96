"""LoRA in the trainer against PEFT itself on the same base model, adapter and batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from trainer_testkit import LLAMA, config, full_optimizer_state, make_batch

from patrl.trainer import Trainer
from patrl.trainer.lora import PEFT_PREFIX, LoraConfig, peft_name, select_targets
from patrl_testkit.models import save_tiny_model
from patrl_testkit.multirank import run_ranks

peft = pytest.importorskip("peft", reason="peft is a test dependency (noxfile TEST_DEPS)")

LORA: dict[str, Any] = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, the same math in a different op order


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lora") / "base", "llama", "plain", **LLAMA)


def _randomise_b(trainer: Trainer, seed: int = 1) -> None:
    """B starts at zero (the identity update); a random B makes A's gradient non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(tuple(p.shape), generator=g) * 0.1)


def _adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in trainer.iter_full_weights(1 << 30) for n, t in b}


def _peft_model(base_dir: Path, trainer: Trainer, lora: dict[str, Any]) -> Any:
    """PEFT's model of the same base with the trainer's adapter values."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=lora["lora_rank"],
        lora_alpha=lora["lora_alpha"],
        target_modules=lora["target_modules"],
        exclude_modules=lora.get("exclude_modules"),
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(base, cfg)
    state = {peft_name(n): t for n, t in _adapters(trainer).items()}
    result = peft.set_peft_model_state_dict(model, state)
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def _logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_only_adapters_train_and_hold_optimizer_state(base_dir: Path) -> None:
    trainer = Trainer(config(lora=LORA), base_dir)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: the 7 projections of each of the 2 layers, never the LM head
    assert len(trainable) == 2 * 7 * 2
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    base_before = {n: p.clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train_step(make_batch(0, [5, 3, 7]))
    state_ids = set(map(id, trainer.optimizer.state))
    assert state_ids == held
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:
            torch.testing.assert_close(p, base_before[n], rtol=0, atol=0)


def test_loss_and_adapter_gradients_equal_peft(base_dir: Path) -> None:
    lora = {**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    trainer = Trainer(config(lora=lora, use_remove_padding=False), base_dir)
    _randomise_b(trainer)
    ref = _peft_model(base_dir, trainer, lora)
    ids = make_batch(3, [6, 6]).input_ids
    x = torch.stack(ids)
    adv = torch.tensor([1.0, -0.5])[:, None]

    def loss_of(model: Any) -> torch.Tensor:
        return -(adv * _logp(model(input_ids=x).logits, x)).mean()

    ours, theirs = loss_of(trainer.model), loss_of(ref)
    torch.testing.assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    peft_grads = {
        n.replace(".default", "").removeprefix("base_model.model."): p.grad
        for n, p in ref.named_parameters()
        if p.requires_grad
    }
    our_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert our_grads.keys() == peft_grads.keys()
    for n, g in our_grads.items():
        assert g is not None and g.abs().sum() > 0, n
        torch.testing.assert_close(g, peft_grads[n], **TOL)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_train_step_equals_peft_with_adamw(base_dir: Path, checkpointing: bool) -> None:
    """One on-policy GRPO step (ratio 1, token-mean): the pg loss, the adapters' grad norm and
    the adapters after AdamW equal PEFT's under the same loss and optimizer (also with
    activation checkpointing, which reruns the adapters' hooks in the backward)."""
    cfg = config(
        lora=LORA,
        use_remove_padding=False,
        grad_clip=1e6,
        enable_gradient_checkpointing=checkpointing,
    )
    trainer = Trainer(cfg, base_dir)
    _randomise_b(trainer)
    ref = _peft_model(base_dir, trainer, LORA)
    batch = make_batch(5, [4, 4, 4])
    metrics = trainer.train_step(batch)

    opt = cfg.optim
    params = [p for p in ref.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(
        params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )
    x = torch.stack(batch.input_ids)
    logp = _logp(ref(input_ids=x).logits, x)
    mask = torch.stack(batch.loss_mask)[:, 1:].float()
    adv = torch.stack(batch.advantages)[:, 1:]
    ratio = (logp - logp.detach()).exp()  # 1, with the gradient of logp
    loss = -(adv * ratio * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    adamw.step()
    assert metrics["actor/pg_loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert metrics["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    after = {
        n.replace(".default", "").removeprefix("base_model.model."): p.detach()
        for n, p in ref.named_parameters()
        if p.requires_grad
    }
    for n, t in _adapters(trainer).items():
        torch.testing.assert_close(t, after[n], rtol=1e-5, atol=1e-6)


def test_reference_is_the_base_with_adapters_off(base_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = Trainer(config(lora=LORA, use_kl_loss=True), base_dir)
    assert trainer.reference is None  # no second model
    _randomise_b(trainer)
    batch = make_batch(7, [5, 2, 6])
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ref = trainer.compute_ref_logprobs(batch)
    policy = trainer.compute_logprobs(batch)
    for ids, r, p in zip(batch.input_ids, ref, policy, strict=True):
        want = _logp(base(input_ids=ids[None]).logits, ids[None])[0]
        torch.testing.assert_close(r[1:], want, **TOL)
        assert not torch.allclose(p[1:], want, rtol=1e-4, atol=1e-4)  # the adapters count


def test_adapter_dir_loads_in_peft_and_merged_export_in_transformers(
    base_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    lora = {**LORA, "exclude_modules": ["layers.0.mlp.up_proj"]}
    trainer = Trainer(config(lora=lora, use_remove_padding=False), base_dir)
    _randomise_b(trainer)
    out = trainer.save_adapter(tmp_path / "adapter")
    assert out is not None
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out)
    x = torch.stack(make_batch(9, [7, 7]).input_ids)
    with torch.no_grad():
        ours = trainer.model(input_ids=x).logits
        torch.testing.assert_close(loaded(input_ids=x).logits, ours, **TOL)
        names = {n for n, _ in loaded.named_parameters() if "lora_A" in n}
        assert not any("layers.0.mlp.up_proj" in n for n in names)
        merged_dir = trainer.export_hf(tmp_path / "merged", dtype=torch.float32)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=x).logits, ours, **TOL)


def test_start_from_an_adapter_path(base_dir: Path, tmp_path: Path) -> None:
    first = Trainer(config(lora=LORA), base_dir)
    _randomise_b(first)
    out = first.save_adapter(tmp_path / "adapter")
    second = Trainer(config(lora={**LORA, "lora_adapter_path": str(out)}), base_dir)
    want, got = _adapters(first), _adapters(second)
    assert want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)


def test_target_entry_matching_nothing_is_an_error(base_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises(ValueError, match=r"model.target_modules entries \['qproj'\].*q_proj"):
        select_targets(model, LoraConfig(lora_rank=2, target_modules=["q_proj", "qproj"]))


def _fsdp_rank(rank: int, world: int, base_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    trainer = Trainer(config(lora=LORA, use_kl_loss=True), base_dir, mesh=mesh)
    metrics = [trainer.train_step(make_batch(s, [5, 3, 7, 2])) for s in range(2)]
    return {
        "metrics": metrics,
        "adapters": {n: t.numpy().copy() for n, t in _adapters(trainer).items()},
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
    }


@pytest.mark.multirank
def test_fsdp2_two_ranks_equal_one_process(base_dir: Path) -> None:
    """The sharded build (meta, per-layer FSDP2, then load; adapters from the seed) takes the
    same steps as a lone process."""
    ranks = run_ranks(_fsdp_rank, 2, (str(base_dir),), timeout_s=240)
    lone = Trainer(config(lora=LORA, use_kl_loss=True), base_dir)
    metrics = [lone.train_step(make_batch(s, [5, 3, 7, 2])) for s in range(2)]
    for got, want in zip(ranks[0]["metrics"], metrics, strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    for n, t in _adapters(lone).items():
        torch.testing.assert_close(torch.from_numpy(ranks[0]["adapters"][n]), t, **TOL)
        torch.testing.assert_close(torch.from_numpy(ranks[1]["adapters"][n]), t, **TOL)


def test_save_resume_and_export_cli_merge(base_dir: Path, tmp_path: Path) -> None:
    """Every save writes the PEFT adapter directory; a resume restores adapters and AdamW
    state (the next step equals an uninterrupted run's); the export CLI writes the merged
    model `Trainer.export_hf` writes."""
    from safetensors.torch import load_file

    from patrl.trainer.export import export_checkpoint

    cfg = config(lora=LORA, use_remove_padding=False)
    batches = [make_batch(s, [5, 3, 6]) for s in range(3)]
    first = Trainer(cfg, base_dir)
    for b in batches[:2]:
        first.train_step(b)
    ckpt = first.save(tmp_path / "ckpt")
    adapter = ckpt / "lora_adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    first.train_step(batches[2])

    resumed = Trainer(cfg, base_dir)
    resumed.load(ckpt)
    resumed.train_step(batches[2])
    want, got = _adapters(first), _adapters(resumed)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)

    out = export_checkpoint(ckpt, tmp_path / "merged_cli", model=base_dir, dtype=torch.float32)
    reloaded = Trainer(cfg, base_dir)
    reloaded.load(ckpt)
    direct = reloaded.export_hf(tmp_path / "merged_direct", dtype=torch.float32)
    cli, live = (
        load_file(str(out / "model.safetensors")),
        load_file(str(direct / "model.safetensors")),
    )
    assert cli.keys() == live.keys() and not any("lora" in n for n in cli)
    for n in cli:
        torch.testing.assert_close(cli[n], live[n], rtol=1e-6, atol=1e-7)


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """As numpy arrays: a rank process's tensors die with it (file descriptors)."""
    return {n: t.detach().numpy().copy() for n, t in tensors.items()}


def _lora_state(trainer: Trainer) -> dict[str, Any]:
    return {
        "adapters": _numpy(_adapters(trainer)),
        "optim": _numpy(full_optimizer_state(trainer)),
        "step": trainer.step,
    }


def _resume_on_two(rank: int, world: int, base_dir: str, tmp: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    trainer = Trainer(config(lora=LORA, use_kl_loss=True), base_dir, mesh=mesh)
    trainer.load(Path(tmp) / "one")
    loaded = _lora_state(trainer)
    trainer.train_step(make_batch(1, [5, 3, 7, 2]))
    trainer.save(Path(tmp) / "two")
    return {"loaded": loaded, "saved": _lora_state(trainer)}


@pytest.mark.multirank
def test_lora_checkpoints_resume_at_another_world_size(base_dir: Path, tmp_path: Path) -> None:
    """As for full runs (test_trainer_fsdp): saved by 1 process, loaded by 2 ranks; saved by
    those 2, loaded by 1 process. Adapters and their AdamW state equal bit for bit each time
    (DCP reshards), the optimizer holds the adapters' state only, and the 2-rank step in
    between is the step the lone process takes."""
    cfg = config(lora=LORA, use_kl_loss=True)
    lone = Trainer(cfg, base_dir)
    lone.train_step(make_batch(0, [5, 3, 7, 2]))
    lone.save(tmp_path / "one")
    saved_one = _lora_state(lone)
    assert saved_one["optim"] and all(".lora_" in n for n in saved_one["optim"])
    ranks = run_ranks(_resume_on_two, 2, (str(base_dir), str(tmp_path)), timeout_s=240)
    resumed = Trainer(cfg, base_dir)
    resumed.load(tmp_path / "two")
    saved_two = _lora_state(resumed)
    lone.train_step(make_batch(1, [5, 3, 7, 2]))
    for got in ranks:
        assert got["loaded"]["step"] == 1 and got["saved"]["step"] == 2
        for part in ("adapters", "optim"):
            assert got["loaded"][part].keys() == saved_one[part].keys()
            for n, t in saved_one[part].items():
                assert (got["loaded"][part][n] == t).all(), (part, n)
            for n, t in got["saved"][part].items():
                assert (saved_two[part][n] == t).all(), (part, n)
    assert saved_two["step"] == 2
    for n, t in _adapters(lone).items():
        torch.testing.assert_close(torch.from_numpy(saved_two["adapters"][n]), t, **TOL)


def test_critic_lora_trains_adapters_and_its_head_over_a_frozen_base_as_peft(
    base_dir: Path,
) -> None:
    """verl's critic.model.lora_*: the value model's adapters train with its head (PEFT's
    TOKEN_CLS task keeps the head in `modules_to_save`), the base stays frozen. Its head output
    and every trainable gradient equal PEFT's on the same base, adapters and head; an update
    moves only those, and only they hold AdamW state."""
    from transformers import AutoModelForTokenClassification

    from patrl.trainer import Critic, CriticConfig
    from patrl.trainer.model import init_value_head

    cfg = CriticConfig.model_validate(
        {"optim": {"lr": 1e-3, "eps": 1e-6}, "lora": LORA, "use_remove_padding": False}
    )
    critic = Critic(cfg, base_dir)
    init_value_head(critic.model, seed=3, std=0.3)  # a zero head would give no gradient
    _randomise_b(critic)
    trainable = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if ".lora_" in n}
    assert len(adapters) == 2 * 7 * 2 and trainable - adapters == {"score.weight", "score.bias"}

    hf = AutoModelForTokenClassification.from_pretrained(base_dir, num_labels=1)
    peft_cfg = peft.LoraConfig(
        r=LORA["lora_rank"],
        lora_alpha=LORA["lora_alpha"],
        # PEFT's all-linear would adapt the TOKEN_CLS head too; patrl's (as PEFT's for an LM)
        # leaves the output layer out: the decoder's projections, named
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        lora_dropout=0.0,
        task_type="TOKEN_CLS",
    )
    ref = peft.get_peft_model(hf, peft_cfg)
    # the adapters and the head, under the names PEFT saves them (the head: modules_to_save)
    state = {
        peft_name(n): p.detach().clone()
        for n, p in critic.model.named_parameters()
        if n in trainable
    }
    assert not peft.set_peft_model_state_dict(ref, state).unexpected_keys
    x = torch.stack(make_batch(2, [6, 6]).input_ids)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ours = (critic.model(input_ids=x).logits[..., 0] * w).sum()
    theirs = (ref(input_ids=x).logits[..., 0] * w).sum()
    torch.testing.assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    peft_grads = {
        n.replace(".default", "").replace(".modules_to_save", "").removeprefix(PEFT_PREFIX): p.grad
        for n, p in ref.named_parameters()
        if p.requires_grad
    }
    assert peft_grads.keys() == trainable
    for n, p in critic.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
            torch.testing.assert_close(p.grad, peft_grads[n], **TOL)
    critic.optimizer.zero_grad(set_to_none=True)

    before = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
    batch = make_batch(4, [3, 5, 2])
    rewards = [torch.zeros(m.shape) for m in batch.loss_mask]
    for r in rewards:
        r[-1] = 1.0
    assert critic.update(batch, rewards, 1.0, 1.0)["critic/grad_norm"] > 0
    for n, p in critic.model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n
    held = {id(p) for p in critic.optimizer.state}
    assert held == {id(p) for p in critic.model.parameters() if p.requires_grad}


def _critic(mesh: Any, base_dir: str) -> Any:
    from patrl.trainer import Critic, CriticConfig

    cfg = CriticConfig.model_validate(
        {"optim": {"lr": 1e-3, "eps": 1e-6}, "lora": LORA, "ppo_max_token_len_per_gpu": 40}
    )
    return Critic(cfg, base_dir, mesh=mesh)


def _critic_batch() -> tuple[Any, list[torch.Tensor]]:
    batch = make_batch(4, [3, 5, 2, 7])
    rewards = [torch.zeros(m.shape) for m in batch.loss_mask]
    for i, r in enumerate(rewards):
        r[-1] = float(i % 2)
    return batch, rewards


def _critic_rank(rank: int, world: int, base_dir: str) -> dict[str, Any]:
    critic = _critic(init_device_mesh("cpu", (world,)), base_dir)
    batch, rewards = _critic_batch()
    metrics = [critic.update(batch, rewards, 1.0, 1.0) for _ in range(2)]
    values = critic.compute_values(batch)
    return {"metrics": metrics, "values": [v.numpy().copy() for v in values]}


@pytest.mark.multirank
def test_critic_lora_fsdp2_two_ranks_equal_one_process(base_dir: Path) -> None:
    """The sharded build (adapters on the meta model, the new head trainable beside them)
    takes the lone process's two value steps."""
    ranks = run_ranks(_critic_rank, 2, (str(base_dir),), timeout_s=240)
    lone = _critic(None, str(base_dir))
    batch, rewards = _critic_batch()
    metrics = [lone.update(batch, rewards, 1.0, 1.0) for _ in range(2)]
    values = lone.compute_values(batch)
    assert metrics[1]["critic/grad_norm"] > 0
    for got in ranks:
        for g, w in zip(got["metrics"], metrics, strict=True):
            for key in ("critic/vf_loss", "critic/grad_norm"):
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-7), key
        for g, w in zip(got["values"], values, strict=True):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-6)


def test_critic_checkpoint_holds_a_peft_adapter_peft_loads(base_dir: Path, tmp_path: Path) -> None:
    """Each critic save writes `lora_adapter/` as the policy's does: PEFT's TOKEN_CLS task with
    the value head in `modules_to_save`. `PeftModel.from_pretrained` over the base's token
    classifier (one label, a random head PEFT replaces) gives the critic's values; the export
    CLI merges the checkpoint into the model `Critic.export_hf` writes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    from patrl.trainer import Critic, CriticConfig
    from patrl.trainer.export import export_checkpoint
    from patrl.trainer.model import init_value_head

    lora = {**LORA, "exclude_modules": ["layers.1.self_attn.k_proj"]}
    cfg = CriticConfig.model_validate(
        {"optim": {"lr": 1e-3, "eps": 1e-6}, "lora": lora, "use_remove_padding": False}
    )
    critic = Critic(cfg, base_dir)
    init_value_head(critic.model, seed=3, std=0.3)
    _randomise_b(critic)
    batch = make_batch(4, [3, 5, 2])
    rewards = [torch.zeros(m.shape) for m in batch.loss_mask]
    for r in rewards:
        r[-1] = 1.0
    critic.update(batch, rewards, 1.0, 1.0)
    ckpt = critic.save(tmp_path / "ckpt")
    adapter = ckpt / "lora_adapter"
    about = json.loads((adapter / "adapter_config.json").read_text())
    assert about["task_type"] == "TOKEN_CLS" and about["modules_to_save"] == ["score"]
    stored = load_file(str(adapter / "adapter_model.safetensors"))
    assert {PEFT_PREFIX + "score.weight", PEFT_PREFIX + "score.bias"} <= stored.keys()
    assert not any("k_proj" in n and "layers.1." in n for n in stored)

    base = AutoModelForTokenClassification.from_pretrained(base_dir, num_labels=1)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    x = torch.stack(make_batch(9, [7, 7]).input_ids)
    with torch.no_grad():
        ours = critic.model(input_ids=x).logits
        torch.testing.assert_close(loaded(input_ids=x).logits, ours, **TOL)

    out = export_checkpoint(ckpt, tmp_path / "merged_cli", model=base_dir, dtype=torch.float32)
    merged = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ours, **TOL)
