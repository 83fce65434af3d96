"""FSDP2 on 2 gloo ranks against a single process on the same data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from trainer_testkit import config, full_optimizer_state, full_weights, make_batch, tiny_llama
from transformers import AutoModelForCausalLM

from patrl.trainer import PolicyBatch, Trainer, TrainerConfig
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.multirank

# Budget 40 padded tokens: several micro-batches per rank, and an uneven split of 7 samples.
CFG: dict[str, Any] = {"use_kl_loss": True, "entropy_coeff": 0.01, "ppo_max_token_len_per_gpu": 40}
BUCKET = 40_000  # bytes: several buckets for this model, one tensor (lm_head, 32 KiB) per bucket


def _batches() -> list[PolicyBatch]:
    return [make_batch(s, [2 + 3 * s, 9, 1, 14, 5, 6 + s, 3]) for s in range(3)]


def _portable(obj: Any) -> Any:
    """Tensors as numpy arrays: torch.multiprocessing would pass tensors by file descriptors
    that die with the rank process before the test reads them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v) for v in obj]
    return obj


def _tensors(obj: Any) -> Any:
    if hasattr(obj, "__array__") and not isinstance(obj, (list, dict)):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors(v) for v in obj]
    return obj


def _mesh(world_size: int) -> Any:
    return init_device_mesh("cpu", (world_size,))


def _fsdp_three_steps(rank: int, world_size: int) -> dict[str, Any]:
    # Activation checkpointing on this side only: FSDP2 + AC must not change the update.
    cfg = config(**CFG, enable_gradient_checkpointing=True)
    trainer = Trainer(cfg, tiny_llama(), mesh=_mesh(world_size))
    metrics = [trainer.train_step(b) for b in _batches()]
    scored = trainer.scored_logprobs()  # each rank scored its share: gathered on every rank
    buckets = [[(n, t.clone()) for n, t in b] for b in trainer.iter_full_weights(BUCKET)]
    return _portable(
        {
            "metrics": metrics,
            "scored": scored,
            "logprobs": trainer.compute_logprobs(_batches()[0]),
            "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
            "bucket_sizes": [len(b) for b in buckets],
            "weights": {n: t for b in buckets for n, t in b},
            "sharded": type(trainer.model.model.layers[0]).__name__,
        }
    )


def test_fsdp_two_ranks_equals_single_process_after_three_steps() -> None:
    ranks = _tensors(run_ranks(_fsdp_three_steps, world_size=2, timeout_s=240))
    single = Trainer(config(**CFG), tiny_llama())
    single_metrics = [single.train_step(b) for b in _batches()]
    for got in ranks:
        assert len(got["scored"]) == len(_batches()[2])
        for a, b in zip(got["scored"], single.scored_logprobs(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    expected = full_weights(single)

    assert ranks[0]["sharded"].startswith("FSDP")
    for got in ranks:  # every rank receives the full weights
        assert got["weights"].keys() == expected.keys()
        for name, t in expected.items():
            torch.testing.assert_close(got["weights"][name], t, atol=1e-6, rtol=0, msg=name)
    init = full_weights(Trainer(config(**CFG), tiny_llama()))
    assert max((expected[n] - init[n]).abs().max().item() for n in init) > 1e-3

    for got_m, want_m in zip(ranks[0]["metrics"], single_metrics, strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert got_m[key] == pytest.approx(want_m[key], rel=1e-5, abs=1e-7), key
    assert ranks[0]["metrics"][0]["actor/ppo_kl"] == 0.0
    assert ranks[0]["metrics"][0]["actor/kl_loss"] == 0.0
    assert ranks[0]["metrics"][2]["actor/kl_loss"] > 0

    want_logp = single.compute_logprobs(_batches()[0])
    for got in ranks:
        for a, b in zip(got["logprobs"], want_logp, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    # Buckets stay within budget unless a single tensor is larger than the budget by itself.
    sizes, counts = ranks[0]["bucket_bytes"], ranks[0]["bucket_sizes"]
    assert len(sizes) > 1
    assert all(s <= BUCKET or c == 1 for s, c in zip(sizes, counts, strict=True))


def _fsdp_resume_and_export(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    # No reference here (it is rebuilt, not checkpointed): fewer models to build per rank.
    no_ref = {**CFG, "use_kl_loss": False}
    cfg = config(**no_ref, optim={"lr": 1e-3, "eps": 1e-6, "lr_warmup_steps": 3})
    batches = [*_batches(), make_batch(9, [4, 8, 2])]
    straight = Trainer(cfg, tiny_llama(), mesh=_mesh(world_size))
    for b in batches:
        straight.train_step(b)
    first = Trainer(cfg, tiny_llama(), mesh=_mesh(world_size))
    for b in batches[:2]:
        first.train_step(b)
    first.save(Path(tmp) / "ckpt")
    resumed = Trainer(cfg, tiny_llama(), mesh=_mesh(world_size))
    resumed.load(Path(tmp) / "ckpt")
    for b in batches[2:]:
        resumed.train_step(b)
    a, b = full_weights(straight), full_weights(resumed)
    resume_diff = max((a[n] - b[n]).abs().max().item() for n in a)

    out = resumed.export_hf(Path(tmp) / "export")
    ids = make_batch(5, [11]).input_ids[0][None]
    with torch.no_grad():
        logits = resumed.model(input_ids=ids).logits
    export_diff = None
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            export_diff = (loaded(input_ids=ids).logits - logits).abs().max().item()
    return {"resume_diff": resume_diff, "export_diff": export_diff, "step": resumed.step}


def test_fsdp_resume_at_step_2_equals_uninterrupted_and_export_loads(tmp_path: Path) -> None:
    ranks = run_ranks(_fsdp_resume_and_export, world_size=2, args=(str(tmp_path),), timeout_s=240)
    assert all(r["resume_diff"] == 0.0 and r["step"] == 4 for r in ranks)
    assert ranks[0]["export_diff"] == 0.0


def _reshard_config() -> TrainerConfig:
    # No reference (it is rebuilt, not checkpointed); a warmup, so the schedule's step counts.
    warmup = {"lr": 1e-3, "eps": 1e-6, "lr_warmup_steps": 3}
    return config(**{**CFG, "use_kl_loss": False}, optim=warmup)


def _state(trainer: Trainer) -> dict[str, Any]:
    return {
        "weights": full_weights(trainer),
        "optim": full_optimizer_state(trainer),
        "step": trainer.step,
        "lr": trainer.scheduler.get_last_lr(),
    }


def _resume_one_rank_checkpoint_on_two(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    trainer = Trainer(_reshard_config(), tiny_llama(), mesh=_mesh(world_size))
    trainer.load(Path(tmp) / "one")
    loaded = _state(trainer)
    trainer.train_step(_batches()[1])
    trainer.save(Path(tmp) / "two")
    return _portable({"loaded": loaded, "saved": _state(trainer)})


def test_checkpoints_load_at_another_world_size(tmp_path: Path) -> None:
    """Saved by 1 process, loaded by 2 ranks; saved by those 2, loaded by 1 process: weights
    and AdamW state equal bit for bit each time (DCP reshards), and the 2-rank step taken in
    between is the step the lone process would have taken."""
    cfg = _reshard_config()
    single = Trainer(cfg, tiny_llama())
    single.train_step(_batches()[0])
    single.save(tmp_path / "one")
    saved_one = _state(single)
    ranks = _tensors(
        run_ranks(
            _resume_one_rank_checkpoint_on_two, world_size=2, args=(str(tmp_path),), timeout_s=240
        )
    )
    resumed = Trainer(cfg, tiny_llama())
    resumed.load(tmp_path / "two")
    saved_two = _state(resumed)
    single.train_step(_batches()[1])
    for got in ranks:
        assert got["loaded"]["step"] == 1 and got["saved"]["step"] == 2
        for part in ("weights", "optim"):
            want = saved_one[part]
            assert got["loaded"][part].keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(got["loaded"][part][name], t), (part, name)
            for name, t in got["saved"][part].items():
                assert torch.equal(saved_two[part][name], t), (part, name)
    assert saved_two["step"] == 2 and saved_two["lr"] == ranks[0]["saved"]["lr"]
    assert saved_two["lr"] == pytest.approx([1e-3 * 3 / 3]) and saved_one["lr"] != saved_two["lr"]
    for name, t in full_weights(single).items():
        torch.testing.assert_close(saved_two["weights"][name], t, atol=1e-6, rtol=0, msg=name)


def _one_rank_mesh(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    trainer = Trainer(config(**CFG), tiny_llama(), _mesh(1))
    for b in _batches():
        trainer.train_step(b)
    return _portable(full_weights(trainer))


def test_one_rank_mesh_equals_no_mesh() -> None:
    (got,) = _tensors(run_ranks(_one_rank_mesh, world_size=1, timeout_s=180))
    single = Trainer(config(**CFG), tiny_llama())
    for b in _batches():
        single.train_step(b)
    for name, t in full_weights(single).items():
        torch.testing.assert_close(got[name], t, atol=1e-6, rtol=0, msg=name)
