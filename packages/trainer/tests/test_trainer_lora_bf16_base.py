"""A LoRA run's frozen base held in the trainer's `param_dtype` (bf16: the CUDA default), its
adapters fp32 masters: half the base's bytes, PEFT's math on a bf16 base, the fp32 base's
loss and gradients within bf16's error, a base that never moves, and FSDP2 over 2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from trainer_testkit import LLAMA, config, make_batch

from patrl.trainer import Critic, CriticConfig, Trainer
from patrl.trainer.lora import LoraConfig, peft_name
from patrl.trainer.model import build_sharded
from patrl_testkit.models import save_tiny_model
from patrl_testkit.multirank import run_ranks

peft = pytest.importorskip("peft", reason="peft is a test dependency (noxfile TEST_DEPS)")

LORA: dict[str, Any] = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}
# The same ops in the same order as PEFT's (bf16 matmuls under autocast on both sides).
TOL = {"rtol": 1e-5, "atol": 1e-6}
# bf16 against fp32: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3 a value),
# compounded over 2 layers and the log-softmax; measured 2.4e-3 relative on the loss' inputs
# and 2.4e-2 on the worst adapter gradient of this tiny model.
BF16_REL = 5e-2


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lora_bf16") / "base", "llama", "plain", **LLAMA)


def _trainer(base_dir: Path, dtype: str, **overrides: Any) -> Trainer:
    """A LoRA trainer with a random B (B starts at zero; a random one gives A a gradient)."""
    trainer = Trainer(config(lora=LORA, param_dtype=dtype, **overrides), base_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(tuple(p.shape), generator=g) * 0.1)
    return trainer


def _frozen_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def _loss(model: Any, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """A policy-gradient-shaped loss; under bf16 autocast as the lone trainer computes."""
    adv = torch.tensor([1.0, -0.5])[:, None]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        return -(adv * _logp(model(input_ids=x).logits, x)).mean()


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_cpu_default_keeps_an_fp32_base(base_dir: Path) -> None:
    """param_dtype "auto" is fp32 on CPU: the base stays fp32 there (bf16 on CUDA)."""
    trainer = Trainer(config(lora=LORA), base_dir)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_bf16_base_halves_its_bytes_and_never_moves(base_dir: Path) -> None:
    fp32 = Trainer(config(lora=LORA, param_dtype="float32"), base_dir)
    bf16 = Trainer(config(lora=LORA, param_dtype="bfloat16"), base_dir)
    assert _frozen_bytes(bf16.model) * 2 == _frozen_bytes(fp32.model) > 0
    frozen = {p.dtype for p in bf16.model.parameters() if not p.requires_grad}
    trained = {n: p.dtype for n, p in bf16.model.named_parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert len(trained) == 2 * 7 * 2 and set(trained.values()) == {torch.float32}
    # the same fresh adapters (PEFT's init from the seed, drawn in fp32)
    for (n, a), (_, b) in zip(
        fp32.model.named_parameters(), bf16.model.named_parameters(), strict=True
    ):
        if n in trained:
            assert torch.equal(a, b), n
    base = {n: p.clone() for n, p in bf16.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.clone() for n, p in bf16.model.named_parameters() if p.requires_grad}
    for seed in range(2):
        metrics = bf16.train_step(make_batch(seed, [5, 3, 7]))
        assert metrics["actor/nonfinite_skipped"] == 0.0
    for n, p in bf16.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n  # the base never changes
    assert any(
        not torch.equal(p, adapters[n]) for n, p in bf16.model.named_parameters() if n in adapters
    )
    state = [t for st in bf16.optimizer.state.values() for t in st.values() if t.numel() > 1]
    assert {id(p) for p in bf16.optimizer.state} == {
        id(p) for p in bf16.model.parameters() if p.requires_grad
    }
    assert state and {t.dtype for t in state} == {torch.float32}


def test_bf16_base_equals_peft_on_a_bf16_base(base_dir: Path) -> None:
    """PEFT on a bf16 base keeps its adapters fp32 (autocast_adapter_dtype); under bf16
    autocast its loss and adapter gradients are the trainer's."""
    from transformers import AutoModelForCausalLM

    trainer = _trainer(base_dir, "bfloat16", use_remove_padding=False)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    cfg = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", lora_dropout=0.0)
    ref = peft.get_peft_model(base, cfg)
    state = {
        peft_name(n): p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    assert not peft.set_peft_model_state_dict(ref, state).unexpected_keys
    x = torch.stack(make_batch(3, [6, 6]).input_ids)
    ours, theirs = _loss(trainer.model, x, bf16=True), _loss(ref, x, bf16=True)
    torch.testing.assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    peft_grads = {
        n.replace(".default", "").removeprefix("base_model.model."): g
        for n, g in _grads(ref).items()
    }
    ours_g = _grads(trainer.model)
    assert ours_g.keys() == peft_grads.keys()
    for n, g in ours_g.items():
        assert g is not None and g.dtype == torch.float32 and g.abs().sum() > 0, n
        torch.testing.assert_close(g, peft_grads[n], **TOL)


def test_bf16_base_loss_and_gradients_are_close_to_the_fp32_base(base_dir: Path) -> None:
    fp32 = _trainer(base_dir, "float32", use_remove_padding=False)
    bf16 = _trainer(base_dir, "bfloat16", use_remove_padding=False)
    x = torch.stack(make_batch(3, [6, 6]).input_ids)
    want, got = _loss(fp32.model, x, bf16=False), _loss(bf16.model, x, bf16=True)
    assert got.item() == pytest.approx(want.item(), rel=BF16_REL)
    assert got.item() != want.item()  # bf16 compute is in effect
    want.backward()
    got.backward()
    gw, gg = _grads(fp32.model), _grads(bf16.model)
    assert gw.keys() == gg.keys()
    for n in gw:
        err = float((gg[n] - gw[n]).norm() / gw[n].norm())
        assert err < BF16_REL, (n, err)
    metrics = [t.train_step(make_batch(5, [5, 3, 7], with_old=True)) for t in (fp32, bf16)]
    for key in ("actor/pg_loss", "actor/entropy", "actor/loss", "actor/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=BF16_REL, abs=2e-3), key


def test_bf16_base_resumes_and_loads_an_fp32_base_checkpoint(
    base_dir: Path, tmp_path: Path
) -> None:
    """A bf16-base checkpoint resumes bit for bit (the next step equals an uninterrupted
    run's); one written with an fp32 base (param_dtype float32) loads into a bf16 base, each
    base weight rounded to bf16 and the adapters exact."""
    batches = [make_batch(s, [5, 3, 7]) for s in range(2)]
    first = Trainer(config(lora=LORA, param_dtype="bfloat16"), base_dir)
    first.train_step(batches[0])
    resumed = Trainer(config(lora=LORA, param_dtype="bfloat16"), base_dir)
    resumed.load(first.save(tmp_path / "bf16"))
    for t in (first, resumed):
        t.train_step(batches[1])
    want = dict(first.model.named_parameters())
    for n, p in resumed.model.named_parameters():
        assert p.dtype == want[n].dtype and torch.equal(p, want[n]), n

    fp32 = Trainer(config(lora=LORA, param_dtype="float32"), base_dir)
    fp32.train_step(batches[0])
    into = Trainer(config(lora=LORA, param_dtype="bfloat16"), base_dir)
    into.load(fp32.save(tmp_path / "fp32"))
    want = dict(fp32.model.named_parameters())
    for n, p in into.model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), n
        assert torch.equal(p, want[n].to(p.dtype)), n


def test_critic_bf16_base_keeps_its_head_fp32(base_dir: Path) -> None:
    """The critic's value head trains whole beside its adapters: an fp32 master too."""
    cfg = CriticConfig.model_validate(
        {"optim": {"lr": 1e-3, "eps": 1e-6}, "lora": LORA, "param_dtype": "bfloat16"}
    )
    critic = Critic(cfg, base_dir)
    trained = {n: p.dtype for n, p in critic.model.named_parameters() if p.requires_grad}
    assert {"score.weight", "score.bias"} <= trained.keys()
    assert set(trained.values()) == {torch.float32}
    assert {p.dtype for p in critic.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    base = {n: p.clone() for n, p in critic.model.named_parameters() if not p.requires_grad}
    batch = make_batch(4, [3, 5, 2])
    rewards = [torch.zeros(m.shape) for m in batch.loss_mask]
    for r in rewards:
        r[-1] = 1.0
    assert critic.update(batch, rewards, 1.0, 1.0)["critic/grad_norm"] > 0
    for n, p in critic.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _sharded_rank(rank: int, world: int, base_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    # 1. the Trainer: a bf16 base, sharded, 2 steps
    cfg = config(lora=LORA, param_dtype="bfloat16", use_kl_loss=True)
    trainer = Trainer(cfg, base_dir, mesh=mesh)
    frozen = {_local(p).dtype for p in trainer.model.parameters() if not p.requires_grad}
    trained = {_local(p).dtype for p in trainer.model.parameters() if p.requires_grad}
    base = {
        n: _local(p).clone() for n, p in trainer.model.named_parameters() if not p.requires_grad
    }
    metrics = [trainer.train_step(make_batch(s, [5, 3, 7, 2])) for s in range(2)]
    moved = [
        n
        for n, p in trainer.model.named_parameters()
        if n in base and not torch.equal(_local(p), base[n])
    ]
    adapters = {
        n: t.float().numpy().copy() for b in trainer.iter_full_weights(1 << 30) for n, t in b
    }
    # 2. FSDP2 computes in bf16 either way: a bf16 base gives the fp32 base's forward and
    # adapter gradients bit for bit (the load rounds the base to bf16 as the all-gather would)
    lora = LoraConfig(**LORA)
    x = torch.stack(make_batch(3, [6, 6]).input_ids)
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = build_sharded(
            base_dir,
            "sdpa",
            mesh,
            torch.device("cpu"),
            torch.bfloat16,
            False,
            lora=lora,
            base_dtype=dtype,
        )
        with torch.no_grad():  # a non-zero B, the same on every rank and both builds
            g = torch.Generator().manual_seed(1)
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    full = torch.randn(tuple(p.shape), generator=g) * 0.1
                    _local(p).copy_(full[_rows(p)])
        logits = model(input_ids=x).logits.float()
        (logits.square().mean()).backward()
        out[name] = {
            "logits": logits.detach().numpy().copy(),
            "grads": {
                n: _local(p.grad).float().numpy().copy()
                for n, p in model.named_parameters()
                if p.requires_grad
            },
            "frozen_local_bytes": sum(
                _local(p).numel() * _local(p).element_size()
                for p in model.parameters()
                if not p.requires_grad
            ),
        }
    return {
        "frozen": sorted(map(str, frozen)),
        "trained": sorted(map(str, trained)),
        "moved": moved,
        "metrics": metrics,
        "adapters": adapters,
        "builds": out,
    }


def _flat_adapters(trainer: Trainer) -> torch.Tensor:
    """Every adapter value, in name order, flattened (fp32)."""
    named = {n: t.float() for b in trainer.iter_full_weights(1 << 30) for n, t in b}
    return torch.cat([named[n].flatten() for n in sorted(named)])


def _rows(p: torch.Tensor) -> slice:
    from patrl.trainer.shard_loader import shard_rows

    assert isinstance(p, DTensor)
    start, stop = shard_rows(p)
    return slice(start, stop)


@pytest.mark.multirank
def test_fsdp2_bf16_base_two_ranks(base_dir: Path) -> None:
    """2 ranks: the sharded base is bf16 (local shards too), the adapters fp32; the base never
    moves; the steps are the lone bf16 trainer's within bf16's error (FSDP2's mixed precision
    and the lone process's autocast round differently); and a bf16 base changes nothing FSDP2
    computes (bit for bit against an fp32 base with bf16 compute)."""
    ranks = run_ranks(_sharded_rank, 2, (str(base_dir),), timeout_s=300)
    lone = Trainer(config(lora=LORA, param_dtype="bfloat16", use_kl_loss=True), base_dir)
    start = _flat_adapters(lone)
    metrics = [lone.train_step(make_batch(s, [5, 3, 7, 2])) for s in range(2)]
    want = _flat_adapters(lone) - start
    for got in ranks:
        assert got["frozen"] == ["torch.bfloat16"] and got["trained"] == ["torch.float32"]
        assert got["moved"] == []
        for g, w in zip(got["metrics"], metrics, strict=True):
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
                assert g[key] == pytest.approx(w[key], rel=BF16_REL, abs=2e-3), key
        # AdamW's first steps move each weight by ~lr * sign(gradient): a bf16 round-off that
        # flips a tiny gradient's sign moves that weight 2 lr the other way, so the updates are
        # compared as a whole (cosine), not entry by entry
        update = (
            torch.cat(
                [torch.from_numpy(got["adapters"][n]).flatten() for n in sorted(got["adapters"])]
            )
            - start
        )
        cos = float(torch.nn.functional.cosine_similarity(update, want, dim=0))
        assert cos > 0.95, cos
        fp32, bf16 = got["builds"]["fp32"], got["builds"]["bf16"]
        assert bf16["frozen_local_bytes"] * 2 == fp32["frozen_local_bytes"]
        assert (bf16["logits"] == fp32["logits"]).all()
        assert fp32["grads"].keys() == bf16["grads"].keys()
        for n, g in fp32["grads"].items():
            assert (bf16["grads"][n] == g).all(), n
